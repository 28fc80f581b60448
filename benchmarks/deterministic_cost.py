"""What --enable-deterministic-inference costs on the CPU: a whole engine decode step (median) at batch 1, 16
and 64, and prefill throughput (prompts of --prompt-len tokens, --prefills of them in chunks of 512), with
the flag off and on, side by side from one run, on the built-in model (SmolLM2-135M, float32) unless
--model says otherwise. The two engines' measurements alternate, so a load change on the machine hits both.

    .venv/bin/python benchmarks/deterministic_cost.py [--steps 20] [--context 128] [--threads 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.parallel import invariant  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402
from tests.integration.tiny_model import random_prompts  # noqa: E402

VOCAB = 49152  # the built-in model's, for the random prompts
BATCHES = (1, 16, 64)


def engine_for(model: str, deterministic: bool) -> Engine:
    config = ServerConfig(
        model=model, max_running_requests=64, max_total_tokens=80_000, enable_deterministic_inference=deterministic
    )
    return Engine(config)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [[t % VOCAB for t in p] for p in random_prompts(n, length, length, seed=seed)]


def decode_step(engine: Engine, batch: int, context: int, steps: int, seed: int) -> float:
    """Median seconds of a scheduler step with `batch` requests decoding at about `context` tokens."""
    s = engine.scheduler
    reqs = [
        Req(f"d{seed}-{i}", p, SamplingParams(max_new_tokens=steps + 8, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts(batch, context, seed))
    ]
    for r in reqs:
        s.add_request(r)
    while len(s.decode.running) < batch:
        s.step()
    s.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        s.step()
        times.append(time.perf_counter() - t0)
    while not all(r.finished for r in reqs):
        s.step()
    return statistics.median(times)


def prefill_rate(engine: Engine, n: int, length: int, seed: int) -> float:
    """Prompt tokens per second of `n` prompts prefilled (one token out each: the first decode is not counted)."""
    s = engine.scheduler
    reqs = [
        Req(f"p{seed}-{i}", p, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts(n, length, seed))
    ]
    t0 = time.perf_counter()
    for r in reqs:
        s.add_request(r)
    while not all(r.finished for r in reqs):
        s.step()
    return n * length / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prefills", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="measurements of each, alternating; the best is kept")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines = {False: engine_for(args.model, False), True: engine_for(args.model, True)}
    results: dict[tuple, float] = {}
    seed = 0
    for what in [*BATCHES, "prefill"]:
        for det in (False, True) * args.rounds:  # alternating; each kept at its best
            invariant.enable(det)  # one switch per process: the engine measured now
            seed += 1  # new prompts every time: no prefix cache hit
            if what == "prefill":
                value = prefill_rate(engines[det], args.prefills, args.prompt_len, seed)
                results[what, det] = max(value, results.get((what, det), 0.0))
            else:
                value = decode_step(engines[det], what, args.context, args.steps, seed)
                results[what, det] = min(value, results.get((what, det), float("inf")))
            print(f"  {what} {'on' if det else 'off'}: {value:.4g}", file=sys.stderr, flush=True)
    print(f"--enable-deterministic-inference on the CPU ({torch.get_num_threads()} threads), model {args.model}")
    print(f"{'':>28} | {'off':>10} | {'on':>10} | {'on / off':>8}")
    for b in BATCHES:
        off, on = results[b, False] * 1e3, results[b, True] * 1e3
        print(f"{f'decode step, batch {b} (ms)':>28} | {off:>10.1f} | {on:>10.1f} | {on / off:>8.2f}")
    off, on = results["prefill", False], results["prefill", True]
    print(f"{'prefill (tokens/s)':>28} | {off:>10.0f} | {on:>10.0f} | {off / on:>8.2f}")
    print("(prefill's ratio is off / on: the time ratio, as the decode rows)")


if __name__ == "__main__":
    main()

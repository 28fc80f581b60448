"""Engine overhead of one decode step: a whole scheduler step (schedule, KV slots, batch tensors,
attention metadata, forward, sampling, token commit) divided by the bare model forward of the same
batch (attention metadata + forward on a prebuilt batch), at batch 1, 16 and 64, on the CPU with a tiny
random model so that the engine's own cost shows. 1.0 would be an engine with no overhead at all.

    .venv/bin/python benchmarks/decode_overhead.py [--steps 40] [--sampling greedy|mixed] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.config import ServerConfig  # noqa: E402
from common.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from common.core.page_meta import build_page_meta  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402
from tests.integration.tiny_model import random_prompts, save_tiny_llama  # noqa: E402

PROMPT_LEN = 32
WARMUP = 5


def params(i: int, mode: str, max_new: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    # every kind of row the sampler knows, mixed in one batch
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_k=20, seed=i),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.7, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1),
    ]
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True, **kinds[i % len(kinds)])


def timed(fn, n: int) -> float:
    """Median seconds of n calls."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bare_batch(engine: Engine, reqs: list[Req]) -> ForwardBatch:
    """The decode batch of these requests' last token, rebuilt by hand (rewrites that token's KV in place)."""
    table = engine.memory.req_pool.req_to_token
    rows = torch.tensor([r.req_pool_idx for r in reqs])
    kv_lens = torch.tensor([r.kv_len for r in reqs])
    pages, _ = build_page_meta([r.kv_len for r in reqs], [1] * len(reqs), engine.config.page_size, "cpu", [])
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([r.fill_ids[r.kv_len - 1] for r in reqs]),
        positions=kv_lens - 1,
        out_cache_loc=table[rows, kv_lens - 1].long(),
        req_pool_indices=rows,
        seq_lens=kv_lens.clone(),
        extend_lens=torch.ones_like(kv_lens),
        logits_indices=torch.arange(len(reqs)),
        req_to_token=table,
        pages=pages,
        rope_lens=pages.seq_lens,
    )


def measure(model_dir: Path, batch: int, steps: int, mode: str) -> tuple[float, float]:
    engine = Engine(ServerConfig(model=str(model_dir), max_running_requests=batch, max_total_tokens=batch * 256 + 1024))
    reqs = [
        Req(f"r{i}", p, params(i, mode, WARMUP + steps + 8))
        for i, p in enumerate(random_prompts(batch, PROMPT_LEN, PROMPT_LEN))
    ]
    s = engine.scheduler
    for r in reqs:
        s.add_request(r)
    while len(s.decode.running) < batch:
        s.step()
    for _ in range(WARMUP):
        s.step()
    step = timed(s.step, steps)
    assert len(s.decode.running) == batch, "a request finished during the measurement"
    fb = bare_batch(engine, reqs)
    runner = engine.runner

    def forward() -> None:
        runner.attn.init_forward(fb)
        runner.model(fb, runner.attn)

    for _ in range(WARMUP):
        forward()
    return step, timed(forward, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sampling", choices=["greedy", "mixed"], default="greedy")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="tandem-tiny-") as tmp:
        model_dir = save_tiny_llama(Path(tmp))
        rows = [(b, *measure(model_dir, b, args.steps, args.sampling)) for b in (1, 16, 64)]
    print(f"decode step, tiny Llama on CPU ({torch.get_num_threads()} threads), sampling: {args.sampling}")
    print(f"{'batch':>5} | {'engine step ms':>14} | {'bare forward ms':>15} | {'step / forward':>14}")
    for b, step, fwd in rows:
        print(f"{b:>5} | {step * 1e3:>14.3f} | {fwd * 1e3:>15.3f} | {step / fwd:>14.2f}")


if __name__ == "__main__":
    main()

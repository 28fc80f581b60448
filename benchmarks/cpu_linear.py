"""The CPU's float32 matrix product: MKL (F.linear) against oneDNN (`common.parallel.layers.linear`),
side by side in one process, first on the built-in model's projections (SmolLM2-135M: 30 layers of qkv,
o, gate_up and down, then the tied LM head), then as the engine's whole decode step at batch 1, 8 and 32.

    .venv/bin/python benchmarks/cpu_linear.py [--threads 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.decode_overhead import timed  # noqa: E402
from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.parallel import layers  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30


def projections_ms(rows: int, product, n: int) -> float:
    """One forward's projections of the built-in model's shapes at `rows` tokens, in ms."""
    shapes = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    weights = [torch.randn(o, i) for o, i in shapes] + [torch.randn(VOCAB, HIDDEN)]
    xs = {i: torch.randn(rows, i) for i in (HIDDEN, INTER)}
    forward = lambda: [product(xs[w.shape[1]], w) for w in weights]  # noqa: E731
    forward()  # warm-up
    return 1e3 * timed(forward, n)


def decode_step_ms(engine: Engine, batch: int, n: int) -> float:
    """The engine's median decode step with `batch` greedy requests running, in ms."""
    s = engine.scheduler
    for i in range(batch):
        s.add_request(
            Req(
                f"b{batch}-{i}",
                list(range(100 + i, 132 + i)),
                SamplingParams(max_new_tokens=3 * n + 8, temperature=0, ignore_eos=True),
            )
        )
    while len(s.decode.running) < batch:
        s.step()
    s.step()  # warm-up
    step = timed(s.step, n)
    assert len(s.decode.running) == batch, "a request finished during the measurement"
    for r in list(s.decode.running):
        s.abort_now(r, "measured", 499)
    return 1e3 * step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"float32 on the CPU, {torch.get_num_threads()} threads; ms, median of {args.steps}")
    print(f"{'what':<28} | {'MKL (F.linear)':>14} | {'oneDNN':>8} | {'MKL / oneDNN':>12}")
    for rows in (1, 8, 64, 256):
        mkl, onednn = (projections_ms(rows, f, args.steps) for f in (F.linear, layers.linear))
        print(f"{f'projections, {rows} tokens':<28} | {mkl:>14.1f} | {onednn:>8.1f} | {mkl / onednn:>12.2f}")
    engine = Engine(ServerConfig(model="builtin", max_running_requests=32, max_total_tokens=8192))
    for batch in (1, 8, 32):
        times = []
        for on in (False, True):
            layers.ONEDNN_LINEAR = on
            times.append(decode_step_ms(engine, batch, args.steps))
        print(
            f"{f'decode step, batch {batch}':<28} | {times[0]:>14.1f} | {times[1]:>8.1f} | {times[0] / times[1]:>12.2f}"
        )


if __name__ == "__main__":
    main()

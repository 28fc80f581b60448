"""The built-in model served from its own Q4_1 GGUF kept in 4 bits (`--quantization gguf`) against its
float32 copy (the default): the engine's decode step at batch 1, 8 and 32 and the weights' resident bytes,
both engines in one process, measured in turn at each batch size.

    .venv/bin/python benchmarks/gguf_decode.py [--threads 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.cpu_linear import decode_step_ms  # noqa: E402
from common.config import ServerConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.model.loader import resident_bytes  # noqa: E402


def engine(quantization: str | None) -> Engine:
    return Engine(
        ServerConfig(model="builtin", quantization=quantization, max_running_requests=32, max_total_tokens=8192)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines = {"float32": engine(None), "gguf Q4_1": engine("gguf")}
    print(f"built-in model on the CPU, {torch.get_num_threads()} threads; ms, median of {args.steps} decode steps")
    print(f"{'what':<24} | {'float32':>10} | {'gguf Q4_1':>10} | {'float32 / gguf':>14}")
    for batch in (1, 8, 32):
        f32, q4 = (decode_step_ms(e, batch, args.steps) for e in engines.values())
        print(f"{f'decode step, batch {batch}':<24} | {f32:>10.1f} | {q4:>10.1f} | {f32 / q4:>14.2f}")
    f32, q4 = (resident_bytes(e.runner.model) / 2**20 for e in engines.values())
    print(f"{'weights resident, MiB':<24} | {f32:>10.1f} | {q4:>10.1f} | {f32 / q4:>14.2f}")


if __name__ == "__main__":
    main()

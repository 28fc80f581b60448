"""An FP8 block checkpoint against its unquantized twin, with Tandem's loader on the CPU: load time, peak
RSS growth, resident weight bytes, and the time of one decode step's linear products (every linear layer
once on a batch of B tokens: the part of a step the weights' format changes).

Writes a random Llama of Llama-3.2-1B's shape (benchmarks/load_memory.py) in bf16 and rewrites it in
DeepSeek's FP8 layout (128x128 blocks, tests/integration/fp8_models.py); each is loaded in bf16 in a fresh
process.

    nice -n 10 .venv/bin/python benchmarks/quant_load.py [--layers 4] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.load_memory import status_kib, write_checkpoint  # noqa: E402

MIB = 1024**2


def measure(path: Path, batches: list[int], dtype: torch.dtype = torch.bfloat16) -> dict:
    """In the child process: load once, then time every linear layer on B tokens (median of 5 rounds)."""
    from common.model.loader import load_hf_config, load_model
    from common.parallel.layers import QuantizableLinear

    before = status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    model = load_model(path, load_hf_config(path), dtype, "cpu")
    out = {"load_s": time.perf_counter() - t0, "peak_growth": status_kib("VmHWM") * 1024 - before}
    out["param_bytes"] = sum({id(p): p.numel() * p.element_size() for p in model.parameters()}.values())
    linears = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
    for b in batches:
        xs = {m.in_features: torch.randn(b, m.in_features, dtype=dtype) for m in linears}
        rounds = []
        with torch.inference_mode():
            for _ in range(5):
                t = time.perf_counter()
                for m in linears:
                    m.matmul(xs[m.in_features], None)
                rounds.append(time.perf_counter() - t)
        out[f"step_ms_b{b}"] = sorted(rounds)[2] * 1000
    return out


def run_child(path: Path, batches: list[int], dtype: str = "bfloat16") -> dict:
    cmd = [sys.executable, __file__, "--measure", str(path), "--batches", *map(str, batches), "--dtype", dtype]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.batches, getattr(torch, args.dtype))))
        return
    from tests.integration.fp8_models import to_fp8_block

    with tempfile.TemporaryDirectory(prefix="tandem-quant-") as tmp:
        plain = Path(tmp) / "bf16"
        plain.mkdir()
        write_checkpoint(plain, args.layers, 5120 * MIB)
        fp8 = to_fp8_block(plain, Path(tmp) / "fp8", (128, 128))
        results = {name: run_child(path, args.batches) for name, path in (("bf16", plain), ("fp8", fp8))}
    table(results, "fp8", "bf16", args.batches)


def table(results: dict[str, dict], quantized: str, twin: str, batches: list[int]) -> None:
    """Both rows and their ratio, as docs/performance.md shows them."""
    keys = ["load_s", "peak_growth", "param_bytes", *[f"step_ms_b{b}" for b in batches]]
    print(f"{'':16}" + "".join(f"{k:>16}" for k in keys))
    for name, r in results.items():
        cells = [f"{r[k] / MIB:.0f} MiB" if "bytes" in k or "peak" in k else f"{r[k]:.3f}" for k in keys]
        print(f"{name:16}" + "".join(f"{c:>16}" for c in cells))
    ratio = [results[quantized][k] / results[twin][k] for k in keys]
    print(f"{quantized + ' / ' + twin:16}" + "".join(f"{r:>16.2f}" for r in ratio))


if __name__ == "__main__":
    main()

"""Peak resident memory of loading a model with Tandem's loader, against the checkpoint's bf16 size.

Writes a random Llama checkpoint of Llama-3.2-1B's shape (bf16 safetensors, several shards) into a
temporary directory, then loads it with `common.model.loader.load_model` in bf16 on the CPU in a fresh
process and reports that process's peak RSS growth (VmHWM after loading - VmRSS before) divided by the
checkpoint's bf16 size. Goal: <= 1.1x (the weights themselves plus one 64 MiB read buffer).

    .venv/bin/python benchmarks/load_memory.py [--layers 16] [--shard-mib 5120] [--keep DIR]
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

GIB = 1024**3
# Llama-3.2-1B's shape (random weights)
SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def write_checkpoint(path: Path, layers: int, shard_bytes: int) -> int:
    """A random bf16 checkpoint in shards of about shard_bytes; returns its tensor bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, architectures=["LlamaForCausalLM"], **SHAPE)
    config.save_pretrained(path)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    shard: dict[str, torch.Tensor] = {}
    total, index = 0, 0
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        shard[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        total += shard[name].nbytes
        if sum(t.nbytes for t in shard.values()) >= shard_bytes:
            save_file(shard, path / f"model-{index:05d}.safetensors")
            shard, index = {}, index + 1
    if shard:
        save_file(shard, path / f"model-{index:05d}.safetensors")
    return total


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure_load(path: Path) -> dict:
    """Runs in the child process: load once, report RSS figures in bytes."""
    from common.model.loader import load_hf_config, load_model

    config = load_hf_config(path)
    before = status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    model = load_model(path, config, torch.bfloat16, "cpu")
    seconds = time.perf_counter() - t0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rss_before": before,
        "peak": status_kib("VmHWM") * 1024,
        "after": status_kib("VmRSS") * 1024,
        "param_bytes": params,
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument(
        "--shard-mib", type=int, default=5120, help="shard size (Hugging Face writes 5 GB shards: one for a 1B model)"
    )
    p.add_argument("--keep", type=Path, help="write (or reuse) the checkpoint here instead of a temporary directory")
    p.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure_load(args.measure)))
        return
    with tempfile.TemporaryDirectory(prefix="tandem-load-") as tmp:
        path = args.keep or Path(tmp)
        path.mkdir(parents=True, exist_ok=True)
        if not (path / "config.json").exists():
            print(f"writing a random {args.layers}-layer 1B-shaped bf16 checkpoint into {path} ...", flush=True)
            write_checkpoint(path, args.layers, args.shard_mib * 1024**2)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        out = subprocess.run(
            [sys.executable, __file__, "--measure", str(path)], capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
    growth = r["peak"] - r["rss_before"]
    print(f"checkpoint (bf16 safetensors): {size / GIB:.2f} GiB; parameters loaded: {r['param_bytes'] / GIB:.2f} GiB")
    print(f"load time: {r['seconds']:.1f} s")
    print(
        f"RSS before load {r['rss_before'] / GIB:.2f} GiB, peak {r['peak'] / GIB:.2f} GiB, after {r['after'] / GIB:.2f} GiB"
    )
    print(f"peak RSS growth: {growth / GIB:.2f} GiB = {growth / size:.2f}x the checkpoint (goal <= 1.10x)")


if __name__ == "__main__":
    main()

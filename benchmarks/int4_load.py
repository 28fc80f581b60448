"""A 4-bit checkpoint against its unquantized float32 twin, with Tandem's loader on the CPU: load time, peak
RSS growth, resident weight bytes, and one decode step's linear products at batch B (every linear layer
once on B tokens: the part of a step the weights' format changes; benchmarks/quant_load.py measures).

Writes a random Llama of the built-in model's shape (SmolLM2-135M: 30 layers, hidden 576, tied embedding) in
float32 and rewrites it in AutoAWQ's GEMM layout in groups of 64 (576 is no multiple of 128) with
tests/integration/int4_models.py; each is loaded in float32 in a fresh process (the int4 layers run torch's
CPU int4 kernel in bfloat16).

    nice -n 10 .venv/bin/python benchmarks/int4_load.py [--layers 30] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.quant_load import run_child, table  # noqa: E402

# SmolLM2-135M-Instruct's shape (random weights)
SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def write_twin(path: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, architectures=["LlamaForCausalLM"], initializer_range=0.02, **SHAPE)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    from tests.integration.int4_models import to_awq

    with tempfile.TemporaryDirectory(prefix="tandem-int4-") as tmp:
        plain = write_twin(Path(tmp) / "float32", args.layers)
        awq = to_awq(plain, Path(tmp) / "awq", 64)
        results = {n: run_child(path, args.batches, "float32") for n, path in (("float32", plain), ("awq", awq))}
    table(results, "awq", "float32", args.batches)


if __name__ == "__main__":
    main()

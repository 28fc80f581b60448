"""Output tokens/s of the monolithic server (over HTTP, streaming) vs Hugging Face transformers'
`generate` on the same machine, model and prompts, at concurrency 1 and 16, measured in one run.

    .venv/bin/python benchmarks/monolithic_vs_hf.py [--num-requests 16] [--input-len 128] [--output-len 64]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tandem.bench import make_prompt, run_bench  # noqa: E402  (same prompts and client as `tandem bench`)
from tests.conftest import start_server  # noqa: E402


def hf_tokens_per_s(model_dir: Path, prompts: list[str], output_len: int, batch: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generated = 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), desc=f"transformers batch {batch}"):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        generated += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return generated / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    from common.model.loader import resolve_model_dir

    model_dir = resolve_model_dir("builtin")
    rng = random.Random(0)
    prompts = [make_prompt(rng, args.input_len) for _ in range(args.num_requests)]
    rows = []
    server = start_server("--max-running-requests", "16", name="bench").wait_ready()
    try:
        for conc in (1, 16):
            ns = argparse.Namespace(url=server.url, num_requests=args.num_requests, concurrency=conc, rate=0.0,
                                    input_len=args.input_len, output_len=args.output_len, seed=0, api_key=None, json=True)
            ours = run_bench(ns)["output_tok_per_s"]
            rows.append((conc, ours))
    finally:
        server.stop()
    results = []
    for conc, ours in rows:
        hf = hf_tokens_per_s(model_dir, prompts, args.output_len, batch=conc)
        results.append((conc, ours, hf))
    print(f"\n{'concurrency':>11} {'tandem tok/s':>13} {'transformers tok/s':>19} {'ratio':>7}")
    for conc, ours, hf in results:
        print(f"{conc:>11} {ours:>13.1f} {hf:>19.1f} {ours / hf:>7.2f}x")


if __name__ == "__main__":
    main()

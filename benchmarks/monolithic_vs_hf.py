"""Output tokens/s of the monolithic server (over HTTP, streaming) vs Hugging Face transformers'
`generate` on the same machine, model and prompts, at concurrency 1 and 16, measured in one run.

    .venv/bin/python benchmarks/monolithic_vs_hf.py [--num-requests 16] [--input-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tandem.bench.flags import add_bench_flags  # noqa: E402  (same prompts and client as `tandem bench`)
from tandem.bench.main import run_bench  # noqa: E402
from tandem.bench.tokenizer import load_tokenizer  # noqa: E402
from tandem.bench.workload import Workload  # noqa: E402
from tests.conftest import start_server  # noqa: E402


def hf_tokens_per_s(model_dir: Path, prompts: list[list[int]], output_len: int, batch: int) -> float:
    """Prompts of equal length, so a batch needs no padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generated = 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), desc=f"transformers batch {batch}"):
        ids = torch.tensor(prompts[i : i + batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
            )
        generated += (out.shape[1] - ids.shape[1]) * out.shape[0]
    return generated / (time.perf_counter() - start)


def bench_args(url: str, concurrency: int, args: argparse.Namespace) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_flags(p)
    return p.parse_args(
        [
            "--base-url",
            url,
            "--num-prompts",
            str(args.num_requests),
            "--max-concurrency",
            str(concurrency),
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--seed",
            str(concurrency),
            "--disable-tqdm",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    from common.model.loader import resolve_model_dir

    model_dir = resolve_model_dir("builtin")
    tokenizer = load_tokenizer("builtin")
    rows = []
    server = start_server("--max-running-requests", "16", name="bench").wait_ready()
    try:
        for conc in (1, 16):  # a seed per concurrency: the second run must not hit the first one's prefix cache
            ours = run_bench(bench_args(server.url, conc, args))["runs"][0]["output_throughput"]
            rows.append((conc, ours))
    finally:
        server.stop()
    results = []
    for conc, ours in rows:
        # the prompts `tandem bench` sent: the first draw of a Workload with the same seed
        prompts = [
            r.prompt_ids
            for r in Workload(tokenizer, conc).random(args.num_requests, args.input_len, args.output_len, 1.0)
        ]
        hf = hf_tokens_per_s(model_dir, prompts, args.output_len, batch=conc)
        results.append((conc, ours, hf))
    print(f"\n{'concurrency':>11} {'tandem tok/s':>13} {'transformers tok/s':>19} {'ratio':>7}")
    for conc, ours, hf in results:
        print(f"{conc:>11} {ours:>13.1f} {hf:>19.1f} {ours / hf:>7.2f}x")


if __name__ == "__main__":
    main()

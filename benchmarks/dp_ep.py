"""TP-MoE vs DP attention + expert parallelism on the CPU (for the record: two ranks share two cores),
one server each on a small random DeepSeek-V3 (MLA, 8 routed + 1 shared experts, top-2), at 2 ranks:

    decode tokens/s at batch 32 (32 requests at once, a short prompt, --new tokens each)
    bytes rank 0 put into collectives per forward (all-reduce for TP-MoE; all-to-all, all-gather for DP+EP)
    KV bytes per rank holding the batch's prompts and answers (MLA: TP-MoE caches every latent on every rank)
    per-DP-rank load: requests served and tokens run

    .venv/bin/python benchmarks/dp_ep.py [--batch 32] [--prompt 64] [--new 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import start_server  # noqa: E402
from tests.integration.test_architectures import save_tiny  # noqa: E402
from tests.integration.tiny_model import random_prompts  # noqa: E402

LAYOUTS = {
    "TP-MoE": ("--tp-size", "2"),
    "DP+EP": ("--tp-size", "2", "--ep-size", "2", "--enable-dp-attention", "--dp-size", "2"),
}
SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4)
SHAPE |= dict(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=192)
SHAPE |= dict(qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2)
SHAPE |= dict(n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1)  # vocabulary: 512


def run(url: str, prompts: list[list[int]], new: int) -> float:
    """Output tokens per second of every prompt at once (decode-bound: the prompts are short)."""
    body = lambda ids: {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}  # noqa: E731
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: httpx.post(url + "/generate", json=body(p), timeout=900).json(), prompts))
    elapsed = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == new for o in outs), outs[0]
    return len(prompts) * new / elapsed


def cached_pages(info: dict) -> list[int]:
    """Pages of the prefix cache on each rank: every rank holds every request's (TP), or its DP rank's."""
    if info["dp"] is None:
        return [info["kv_pages"]["cached"]] * info["tp"]["size"]
    return [r["kv_pages"]["cached"] for r in info["dp"]["ranks"]]


def report(name: str, server, before: dict, tokens_s: float) -> None:
    """One table row: tokens/s, forwards, bytes into collectives per forward; KV bytes per rank; DP load."""
    info = server.info()
    tp, dp = info["tp"], info["dp"]
    steps = tp["forwards"] - before["tp"]["forwards"]
    sent = {k: (v - before["tp"]["bytes_sent"].get(k, 0)) / steps for k, v in tp["bytes_sent"].items()}
    page_bytes = tp["ranks"][0]["kv_pool_bytes"] / tp["ranks"][0]["kv_pages"]
    per_rank = [(a - b) * page_bytes for a, b in zip(cached_pages(info), cached_pages(before))]
    load = "-"
    if dp is not None:
        load = ", ".join(
            f"rank {r['dp_rank']}: {r['requests_served']} req / {r['forward_tokens']} tok" for r in dp["ranks"]
        )
    print(
        f"| {name} | {tokens_s:.0f} | {steps} | " + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in sent.items() if v)
    )
    print(f"|   KV per rank: {', '.join(f'{b / 2**20:.2f} MiB' for b in per_rank)} | load: {load}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny(Path(tmp), "deepseek_v3", SHAPE)
        prompts = random_prompts(ns.batch, ns.prompt, ns.prompt, seed=1)
        print("| layout | decode tok/s | forwards | bytes rank 0 sent into collectives per forward |")
        for name, flags in LAYOUTS.items():  # one at a time: they share the cores
            server = start_server("--model", tmp, "--max-running-requests", str(ns.batch), *flags, name=name)
            try:
                server.wait_ready(600)
                run(server.url, prompts[:2], 4)  # warm
                before = server.info()
                report(name, server, before, run(server.url, prompts, ns.new))
            finally:
                server.stop()


if __name__ == "__main__":
    main()

"""A cold server's TTFT on prefixes another server computed: from the KV store vs computing them.

Two servers of the built-in model share a store (`--hicache-storage-backend mooncake`: a Mooncake master and a
memory-holding client on 127.0.0.1, over TCP; or `--backend file`: a directory): W computes each prompt
(nothing cached: the recompute baseline, its TTFT with the store missing), then C, which never saw it, is sent
the same prompt (its prefix read from the store). Then C is restarted and sent the first prompts again (warm
from the store after a restart). Per prefix length: TTFT (client side, one output token, mean of --prompts
runs), cached tokens, bytes C read from the store, and the ratio compute / store.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_store.py [--lengths 2048 8000] [--prompts 2] [--backend mooncake]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import start_server  # noqa: E402
from tests.integration.kv_store_procs import MooncakeStoreProcs  # noqa: E402

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "512", "--max-total-tokens", "9216")
HOST = ("--enable-hierarchical-cache", "--hicache-ratio", "1.5", "--hicache-storage-prefetch-policy", "wait_complete")
VOCAB = 49152


def ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the one output token, cached prompt tokens)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    start = time.perf_counter()
    r = httpx.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start, r.json()["meta_info"]["cached_tokens"]


def store_bytes(server) -> int:
    return server.info()["kv_store"]["bytes_read"]


def settle(server) -> None:
    """Until the server's store writes are done (no host page locked by one)."""
    while server.info()["host_tier"]["locked"]:
        time.sleep(0.2)


def measure(w, c, prompts: list[list[int]]) -> dict:
    rows = {"compute": [], "store": [], "cached": [], "bytes": []}
    for p in prompts:
        seconds, cached = ttft(w.url, p)
        assert cached == 0, "W had the prompt cached: use fresh prompts"
        rows["compute"].append(seconds)
        settle(w)
        before = store_bytes(c)
        seconds, cached = ttft(c.url, p)
        rows["store"].append(seconds)
        rows["cached"].append(cached)
        rows["bytes"].append(store_bytes(c) - before)
    return rows


def warm_after_restart(c, prompts: list[list[int]]) -> dict:
    c.restart().wait_ready(600)
    rows = {"store": [], "cached": [], "bytes": []}
    for p in prompts:
        before = store_bytes(c)
        seconds, cached = ttft(c.url, p)
        rows["store"].append(seconds)
        rows["cached"].append(cached)
        rows["bytes"].append(store_bytes(c) - before)
    return rows


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per length")
    ap.add_argument("--backend", choices=["mooncake", "file"], default="mooncake")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = {n: [[rng.randrange(VOCAB) for _ in range(n)] for _ in range(args.prompts)] for n in args.lengths}
    store, tmp = None, tempfile.TemporaryDirectory()
    if args.backend == "mooncake":
        store = MooncakeStoreProcs(size="3GB", lease_ttl_ms=10_000, name="bench-kv-store")
        extra = store.extra_config()
    else:
        extra = json.dumps({"file_path": tmp.name})
    flags = ("--model", "builtin", *FLAGS, *HOST, "--hicache-storage-backend", args.backend)
    flags += ("--hicache-storage-backend-extra-config", extra)
    w = start_server(*flags, name="bench-store-w")
    c = start_server(*flags, name="bench-store-c")
    try:
        w.wait_ready(600), c.wait_ready(600)
        ttft(w.url, [rng.randrange(VOCAB) for _ in range(64)])  # first-use costs out of the measurements
        results = {n: measure(w, c, ps) for n, ps in prompts.items()}
        restarted = warm_after_restart(c, [ps[0] for ps in prompts.values()])
    finally:
        w.stop(), c.stop()
        if store is not None:
            store.stop()
        tmp.cleanup()
    print(f"backend {args.backend}, built-in model, page 16; mean of {args.prompts} prompts per length")
    print("| prefix | TTFT computed (W) | TTFT from the store (cold C) | compute / store | cached | MiB read |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, r in results.items():
        ratio = mean(r["compute"]) / mean(r["store"])
        mib = mean(r["bytes"]) / 2**20
        print(
            f"| {n} | {mean(r['compute']):.3f} s | {mean(r['store']):.3f} s | {ratio:.1f}x | "
            f"{r['cached'][0]} | {mib:.1f} |"
        )
    print("after restarting C (its first prompt of each length again):")
    for (n, r), seconds, cached, nbytes in zip(
        results.items(), restarted["store"], restarted["cached"], restarted["bytes"], strict=True
    ):
        print(
            f"| {n} | {mean(r['compute']):.3f} s | {seconds:.3f} s | {mean(r['compute']) / seconds:.1f}x | "
            f"{cached} | {nbytes / 2**20:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "restarted": restarted}, indent=1))


if __name__ == "__main__":
    main()

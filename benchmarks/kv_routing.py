"""Cache hits per routing policy on a multi-turn workload: 2 prefills + 2 decodes publishing KV cache events,
8 conversations x 4 turns (`tandem bench --dataset-name multi-turn`) through a router per policy (kv_aware,
cache_aware, round_robin) with 1 and with 2 router processes, each run with its own seed (no run reuses
another's pages).

Per run: the prefill and decode hit rates the servers report (cached prompt tokens / prompt tokens on each side,
from the bench's usage counts), the share of prompt tokens the chosen prefill and decode held by the router's KV index
(`tandem_router_kv_matched_tokens_total`, counted under every policy), the oracle's (a router that knows the
conversations and keeps each on one pair: from turn 2 on, the prefill holds the last prompt's whole pages and
the decode the last prompt and answer's), and TTFT p50/p99 per turn.

    .venv/bin/python benchmarks/kv_routing.py [--json out.json] [--policies kv_aware ...] [--kv-load-tokens N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from router.placement.policies import POLICIES  # noqa: E402
from tests.integration.cluster import start_cluster, start_router  # noqa: E402

PAGE, CONVS, TURNS, FIRST, ANSWER, ADDED = 16, 8, 4, 256, 16, 32
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
FLAGS = ("--page-size", str(PAGE), "--chunked-prefill-size", "512", "--kv-events-config", EVENTS)
COMPARED = ("kv_aware", "cache_aware", "round_robin")


def router_sample(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items())
    )


def wait_subscribed(url: str, processes: int, timeout: float = 60) -> None:
    """Until every router process follows all four workers (one index sample each)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        n = sum(
            1
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "tandem_router_kv_index_pages"
        )
        if n >= 4 * processes:
            time.sleep(2)  # the feeds subscribe within half a second of seeing a worker
            return
        time.sleep(0.5)
    raise TimeoutError("the router did not follow the workers' events")


def bench(url: str, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tandem", "bench", "--backend", "sglang", "--base-url", url]
    cmd += ["--dataset-name", "multi-turn", "--num-prompts", str(CONVS), "--mt-num-turns", str(TURNS)]
    cmd += ["--random-input-len", str(FIRST), "--random-output-len", str(ANSWER), "--random-range-ratio", "1"]
    cmd += ["--mt-turn-input-len", str(ADDED), "--seed", str(seed), "--output-json", str(out), "--disable-tqdm"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]


def oracle() -> tuple[float, float]:
    """(prefill, decode) share of prompt tokens held by a pair that keeps each conversation."""
    prompts = [FIRST + k * (ANSWER + ADDED) for k in range(TURNS)]
    total = sum(prompts)
    prefill = sum(p // PAGE * PAGE for p in prompts[:-1])
    decode = sum((p + ANSWER - 1) // PAGE * PAGE for p in prompts[:-1])  # the last answer token has no KV yet
    return prefill / total, decode / total


def one_run(cluster, policy: str, processes: int, seed: int, tmp: Path, load_tokens: int) -> dict:
    prefills = list(zip(cluster.prefills, cluster.prefill_bootstrap_ports))
    flags = ("--processes", str(processes), "--health-check-interval-s", "0.5", "--kv-load-tokens", str(load_tokens))
    router = start_router(prefills, cluster.decodes, *flags, policy=policy)
    try:
        wait_subscribed(router.url, processes)
        run = bench(router.url, seed, tmp / f"{policy}-{processes}.json")
        prompt = router_sample(router.url, "tandem_router_kv_prompt_tokens_total")
        held = {
            side: router_sample(router.url, "tandem_router_kv_matched_tokens_total", {"worker_role": side}) / prompt
            for side in ("prefill", "decode")
        }
    finally:
        router.stop()
    turns = run["turns"]
    prompt_tokens = sum(t["input_tokens"] for t in turns)
    return {
        "policy": policy,
        "processes": processes,
        "prefill_hit_servers": sum(t["cached_tokens"] or 0 for t in turns) / prompt_tokens,
        "decode_hit_servers": sum(t["decode_cached_tokens"] or 0 for t in turns) / prompt_tokens,
        "prefill_held_index": held["prefill"],
        "decode_held_index": held["decode"],
        "ttft_ms_per_turn": [(t["turn"], t["p50_ttft_ms"], t["p99_ttft_ms"]) for t in turns],
        "failed": sum(t["failed"] for t in turns),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(COMPARED))
    ap.add_argument("--kv-load-tokens", type=int, default=64, help="the router flag, for kv_aware")
    ns = ap.parse_args()
    runs = [(p, n) for p in ns.policies for n in (1, 2)]
    cluster = start_cluster("mooncake", n_prefill=2, n_decode=2, flags=FLAGS, policy="kv_aware", ready_timeout=900)
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, (policy, processes) in enumerate(runs):
                results.append(one_run(cluster, policy, processes, 1000 + i, Path(tmp), ns.kv_load_tokens))
                print(json.dumps(results[-1]), flush=True)
    finally:
        cluster.stop()
    best = oracle()
    print(f"oracle: prefill {best[0]:.3f}, decode {best[1]:.3f}")
    print("| policy | router processes | prefill hit | decode hit | prefill held (index) | decode held (index) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['policy']} | {r['processes']} | {r['prefill_hit_servers']:.3f} | {r['decode_hit_servers']:.3f} "
            f"| {r['prefill_held_index']:.3f} | {r['decode_held_index']:.3f} |"
        )
    print("| policy | processes | " + " | ".join(f"turn {k + 1} TTFT p50 / p99 ms" for k in range(TURNS)) + " |")
    for r in results:
        cells = " | ".join(f"{p50:.0f} / {p99:.0f}" for _, p50, p99 in r["ttft_ms_per_turn"])
        print(f"| {r['policy']} | {r['processes']} | {cells} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"oracle": best, "runs": results}, indent=2))


if __name__ == "__main__":
    main()

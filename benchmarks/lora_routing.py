"""Cache hits of a multi-tenant multi-turn load through the kv_aware router, with and without adapter-aware routing.

One PD cluster (PREFILLS prefills of POOL tokens of KV each, less than the load's working set, + 1 decode, over
Mooncake; the tiny random Llama, every server with the same TENANTS random PEFT adapters and publishing KV cache
events) and two kv_aware routers over it: one reading the workers'
adapters (the default), one with --no-adapter-routing (every request placed and hashed as the base model's, as
before the router knew adapters: an adapter's pages, hashed from its own root, never match). Each router runs the
same load with its own seed (no run reuses another's pages): per tenant (adapter) CONVS conversations of TURNS
turns, all at once, the turns of one conversation in order; a first prompt is the tenant's system prompt
(SYSTEM tokens, shared by its conversations) and FIRST tokens of its own, each later turn the last prompt, its
answer (ANSWER tokens) and ADDED new tokens.

Per run: the prefill hit rate the servers report (cached prompt tokens / prompt tokens, /generate's
meta_info.cached_tokens), the share of prompt tokens the chosen prefill held by the router's KV index
(`tandem_router_kv_matched_tokens_total`), and the oracle's (each conversation kept on one prefill, each tenant's
system prompt computed once per prefill it runs on: here, on one).

    .venv/bin/python benchmarks/lora_routing.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.kv_routing import router_sample  # noqa: E402
from tests.integration.cluster import start_cluster, start_router  # noqa: E402
from tests.integration.test_lora import save_adapter  # noqa: E402
from tests.integration.tiny_model import VOCAB, save_tiny_llama  # noqa: E402

PAGE, TENANTS, CONVS, TURNS, SYSTEM, FIRST, ANSWER, ADDED = 16, 4, 3, 4, 128, 64, 16, 32
PREFILLS, POOL = 3, 2048  # the load's working set: about 12 x 336 tokens
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})


def tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()


def conversation(url: str, adapter: str, system: list[int], g_seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn of one conversation under `adapter`."""
    g = torch.Generator().manual_seed(g_seed)
    prompt, out = system + tokens(g, FIRST), []
    for _ in range(TURNS):
        params = {"max_new_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/generate", json={"input_ids": prompt, "lora_path": adapter, "sampling_params": params})
        r.raise_for_status()
        answer = r.json()
        out.append((len(prompt), answer["meta_info"]["cached_tokens"]))
        prompt = prompt + answer["output_ids"] + tokens(g, ADDED)
    return out


def load(url: str, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    systems = {f"t{i}": tokens(g, SYSTEM) for i in range(TENANTS)}
    jobs = [(a, s, seed * 1000 + i * CONVS + c) for i, (a, s) in enumerate(systems.items()) for c in range(CONVS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [turn for conv in pool.map(lambda j: conversation(url, *j), jobs) for turn in conv]


def wait_subscribed(url: str, timeout: float = 60) -> None:
    """Until the router follows every worker's events (one index sample each)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        if text.count("tandem_router_kv_index_pages{") >= PREFILLS + 1:
            time.sleep(2)
            return
        time.sleep(0.5)
    raise TimeoutError("the router did not follow the workers' events")


def one_run(cluster, adapter_routing: bool, seed: int) -> dict:
    prefills = list(zip(cluster.prefills, cluster.prefill_bootstrap_ports))
    flags = ("--health-check-interval-s", "0.5", "--adapter-routing" if adapter_routing else "--no-adapter-routing")
    router = start_router(prefills, cluster.decodes, *flags, policy="kv_aware")
    try:
        wait_subscribed(router.url)
        time.sleep(1)  # a health round: the workers' /v1/models
        turns = load(router.url, seed)
        prompt = router_sample(router.url, "tandem_router_kv_prompt_tokens_total")
        held = router_sample(router.url, "tandem_router_kv_matched_tokens_total", {"worker_role": "prefill"})
    finally:
        router.stop()
    total = sum(n for n, _ in turns)
    return {
        "adapter_routing": adapter_routing,
        "prompt_tokens": total,
        "prefill_hit_servers": sum(c for _, c in turns) / total,
        "prefill_held_index": held / prompt,
    }


def oracle() -> float:
    """Each conversation on one prefill, each tenant on one: what is cached of each turn's prompt (whole pages)."""
    prompts = [SYSTEM + FIRST + k * (ANSWER + ADDED) for k in range(TURNS)]
    per_tenant = (CONVS - 1) * (SYSTEM // PAGE * PAGE) + CONVS * sum(p // PAGE * PAGE for p in prompts[:-1])
    return per_tenant / (CONVS * sum(prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = save_tiny_llama(Path(tmp) / "base")
        paths = [
            f"t{i}={save_adapter(base, Path(tmp) / f't{i}', 4, 8, ['q_proj', 'v_proj'], i)}" for i in range(TENANTS)
        ]
        flags = ("--model", str(base), "--page-size", str(PAGE), "--kv-events-config", EVENTS, "--enable-lora")
        flags += ("--max-loras-per-batch", str(TENANTS), "--lora-paths", *paths)
        pool = ("--max-total-tokens", str(POOL))
        cluster = start_cluster("mooncake", PREFILLS, 1, flags, prefill_flags=pool, policy="kv_aware")
        try:
            results = [one_run(cluster, on, seed) for seed, on in ((1, True), (2, False))]
        finally:
            cluster.stop()
    for r in results:
        print(json.dumps(r), flush=True)
    print(f"oracle: prefill {oracle():.3f}")
    print("| adapter-aware routing | prompt tokens | prefill hit (servers) | held by the prefill (router's index) |")
    print("| --- | --- | --- | --- |")
    for r in results:
        on = "on" if r["adapter_routing"] else "off (--no-adapter-routing)"
        print(f"| {on} | {r['prompt_tokens']} | {r['prefill_hit_servers']:.3f} | {r['prefill_held_index']:.3f} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"oracle": oracle(), "runs": results}, indent=2))


if __name__ == "__main__":
    main()

"""The decode's prefix cache on a 2-prefill, 2-decode cluster (Mooncake TCP, SmolLM2-135M on the CPU):
conversations of K turns sent turn by turn (every conversation's turn k at once, then turn k+1 with each
prompt = the last prompt + its answer + new tokens), so the prefills' `bytes_sent` counters split exactly
by turn. Three runs, each on a fresh cluster: the decodes' cache on with the router's `--decode-policy
cache_aware` (a next turn goes to the decode that holds the last one), on with the default decode policy
(power_of_two), and off (`--disable-radix-cache` on the decodes). Prints a markdown table per run and
writes them as JSON.

    .venv/bin/python benchmarks/decode_cache.py [--conversations 8] [--turns 4] [--out docs/performance]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tandem.bench.client import timed_request  # noqa: E402
from tandem.bench.endpoint import Endpoint  # noqa: E402
from tandem.bench.multiturn import answer_ids, build_conversations  # noqa: E402
from tandem.bench.runner import make_session  # noqa: E402
from tandem.bench.tokenizer import load_tokenizer  # noqa: E402
from tandem.bench.workload import Workload  # noqa: E402
from tests.conftest import metric  # noqa: E402
from tests.integration.cluster import start_cluster  # noqa: E402

ENGINE = ("--page-size", "16", "--chunked-prefill-size", "512", "--max-total-tokens", "32768")
RUNS = {  # name -> (decode flags, router flags)
    "decode cache on, --decode-policy cache_aware": ((), ("--decode-policy", "cache_aware")),
    "decode cache off": (("--disable-radix-cache",), ()),
    "decode cache on, decode policy power_of_two": ((), ()),
}


def bytes_sent(cluster) -> float:
    return sum(metric(p.url, "tandem_kv_transfer_events_total", event="bytes_sent") for p in cluster.prefills)


async def lockstep(cluster, ns: argparse.Namespace, w: Workload) -> list[dict]:
    """Every conversation's turn k at once, then k+1; per turn: bytes sent, cached tokens, TTFT."""
    conversations = build_conversations(ns, w)
    endpoint = Endpoint(cluster.url, "sglang", None, token_ids=True)
    prompts = [c.first for c in conversations]
    rows = []
    async with make_session(None, 600) as session:
        for turn in range(1, ns.mt_num_turns + 1):
            before = bytes_sent(cluster)
            outs = await asyncio.gather(
                *(timed_request(session, endpoint, w.request(p, ns.random_output_len)) for p in prompts)
            )
            failed = [o.error for o in outs if not o.success]
            if failed:
                raise SystemExit(f"turn {turn}: {len(failed)} requests failed: {failed[0]}")
            ttft = np.array([o.ttft for o in outs]) * 1000
            rows.append(
                {
                    "turn": turn,
                    "prompt_tokens": sum(len(p) for p in prompts),
                    "bytes_sent": bytes_sent(cluster) - before,
                    "prefill_cached_tokens": sum(o.cached_tokens or 0 for o in outs),
                    "decode_cached_tokens": sum(o.decode_cached_tokens or 0 for o in outs),
                    "p50_ttft_ms": float(np.percentile(ttft, 50)),
                    "p99_ttft_ms": float(np.percentile(ttft, 99)),
                }
            )
            if turn < ns.mt_num_turns:
                prompts = [
                    p + answer_ids(w, o) + c.additions[turn - 1] for p, o, c in zip(prompts, outs, conversations)
                ]
    return rows


def table(name: str, rows: list[dict]) -> str:
    lines = [
        f"**{name}**",
        "",
        "| turn | prompt tokens | KV bytes sent | prefill cached | decode cached | TTFT p50 (ms) | TTFT p99 (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['bytes_sent'] / 1e6:.2f} MB | {r['prefill_cached_tokens']} "
            f"| {r['decode_cached_tokens']} | {r['p50_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=256)
    p.add_argument("--new-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "performance")
    args = p.parse_args()
    ns = argparse.Namespace(
        num_prompts=args.conversations,
        random_input_len=args.first_len,
        random_range_ratio=1.0,
        random_output_len=args.answer_len,
        mt_num_turns=args.turns,
        mt_turn_input_len=args.new_len,
    )
    results = {}
    for name, (decode_flags, router_flags) in RUNS.items():
        cluster = start_cluster(
            "mooncake",
            n_prefill=2,
            n_decode=2,
            flags=ENGINE,
            decode_flags=decode_flags,
            policy="cache_aware",
            router_flags=router_flags,
            ready_timeout=900,  # four servers loading at once on a busy machine
        )
        try:
            results[name] = asyncio.run(lockstep(cluster, ns, Workload(load_tokenizer("builtin"), 1)))
            cluster.wait_idle()
        finally:
            cluster.stop()
        print(table(name, results[name]) + "\n", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"config": vars(ns), "runs": results}
        (args.out / "decode_cache.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Where prompts are computed, measured (docs/placement.md): 2 prefills + 2 decodes (`--model`) publishing
KV cache events, one router per rule over the same workers (--pd-placement remote: always on a prefill; two_way: on
the decode when the part it lacks is under --placement-local-threshold; cost: the three-way cost), and a mixed
workload through each in turn, with fresh prompts per rule (no rule reuses another's pages):

    50% short      64-token prompts
    30% multi-turn conversations of TURNS turns: a shared system prefix, then each turn the last turn's prompt
                   and answer and 64 new tokens
    20% long       2048-token prompts

requests arriving as a Poisson process at --rate, every one streamed with --output-tokens tokens. Per rule: TTFT
p50/p99 per class (as the client saw it), the KV bytes the prefills sent (tandem_kv_transfer_events{bytes_sent}),
the placements by path, and failed requests.

    .venv/bin/python benchmarks/placement_bench.py [--requests 60] [--rate 1.5] [--rules remote two_way cost]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.integration.cluster import start_cluster, start_router  # noqa: E402

PAGE, SHORT, LONG, SYSTEM, TURN_NEW, TURNS, SMALL_VOCAB = 16, 64, 2048, 256, 64, 3, 4096
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
FLAGS = ("--page-size", str(PAGE), "--chunked-prefill-size", "256", "--max-total-tokens", "16384",
         "--kv-events-config", EVENTS)  # fmt: skip


def bench_model(name: str) -> tuple[str, int]:
    """(--model for the servers, its vocabulary): the built-in model, or `small`, a random Llama saved once under
    the temp dir (4 layers, hidden 256, vocabulary 4096, context 4096): a 2k-token prompt costs a few hundred ms of
    CPU, where the built-in model's cost seconds the shared test machine cannot give at a useful rate."""
    if name != "small":
        return name, 49152
    path = Path(tempfile.gettempdir()) / "tandem-bench-small-llama"
    if not (path / "config.json").is_file():
        import torch
        from tokenizers import Tokenizer, models
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=SMALL_VOCAB, max_position_embeddings=4096,
                             tie_word_embeddings=False)  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
        words = {f"t{i}": i for i in range(SMALL_VOCAB)}
        tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"t{SMALL_VOCAB - 1}").save_pretrained(path)
    return str(path), SMALL_VOCAB


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def bytes_sent(cluster) -> float:
    return sum(
        v
        for p in cluster.nodes
        for labels, v in samples(p.url, "tandem_kv_transfer_events_total")
        if labels.get("event") == "bytes_sent"
    )


def workload(n: int, seed: int, vocab: int) -> list[tuple[str, list[int] | int]]:
    """(class, prompt) for independent requests, (multi-turn, conversation index) for a conversation's turn, in
    arrival order: a conversation's turns are spread over the run, each after the last one answered."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(vocab - 1) for _ in range(k)]  # noqa: E731
    system = ids(SYSTEM)
    conversations = max(1, round(0.3 * n / TURNS))
    items: list[tuple[str, list[int] | int]] = [("multi-turn", c) for c in range(conversations) for _ in range(TURNS)]
    rest = n - len(items)
    items += [("long", ids(LONG)) for _ in range(round(rest * 2 / 7))]
    items += [("short", ids(SHORT)) for _ in range(n - len(items))]
    rng.shuffle(items)
    return [("system", system), *items]


async def stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int
) -> tuple[float | None, float | None, list[int]]:
    """(TTFT, TPOT, output ids) of one streamed /generate; TTFT None when it failed. TPOT: the mean time between
    output tokens after the first (None with one token)."""
    body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                                      "ignore_eos": True}}  # fmt: skip
    start, ttft, first_at, last = time.monotonic(), None, None, None
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            return None, None, []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return None, None, []
                if ttft is None:
                    first_at = time.monotonic()
                    ttft = first_at - start
                last = event
    out = last["output_ids"] if last else []
    tpot = (time.monotonic() - first_at) / (len(out) - 1) if len(out) > 1 else None
    return ttft, tpot, out


async def run_rule(url: str, items, rate: float, tokens: int, seed: int, vocab: int) -> dict:
    rng = random.Random(seed)
    system = items[0][1]
    history: dict[int, list[int]] = {}
    turns: dict[int, asyncio.Lock] = {}  # a conversation's turns one after another, in arrival order
    ttfts: dict[str, list[float]] = {"short": [], "multi-turn": [], "long": []}
    failed = 0

    async def ask(kind: str, prompt: list[int], client: httpx.AsyncClient) -> list[int]:
        nonlocal failed
        ttft, _, out = await stream(client, url, prompt, tokens)
        if ttft is None:
            failed += 1
        else:
            ttfts[kind].append(ttft)
        return out

    async def one(kind: str, what, client: httpx.AsyncClient) -> None:
        if kind != "multi-turn":
            await ask(kind, what, client)
            return
        async with turns.setdefault(what, asyncio.Lock()):
            prompt = history.get(what, system) + [rng.randrange(vocab - 1) for _ in range(TURN_NEW)]
            history[what] = prompt + await ask(kind, prompt, client)

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for kind, what in items[1:]:
            tasks.append(asyncio.create_task(one(kind, what, client)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return {"ttft": ttfts, "failed": failed}


def quantiles(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    return f"{1000 * statistics.median(xs):7.0f} {1000 * p99:7.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rules", nargs="+", default=["remote", "two_way", "cost"])
    ap.add_argument("--model", default="small", help="builtin, small (see bench_model) or a model path")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one torch thread per server: several share a few cores
    model, vocab = bench_model(args.model)
    flags = ("--model", model, *FLAGS)
    cluster = start_cluster("mooncake", n_prefill=2, n_decode=2, flags=flags, policy="kv_aware", ready_timeout=900)
    routers = {}
    try:
        pairs = list(zip(cluster.prefills, cluster.prefill_bootstrap_ports))
        for rule in args.rules:
            rflags = ("--pd-placement", rule, "--placement-poll-interval-s", "0.5", "--health-check-interval-s", "0.5")
            routers[rule] = start_router(pairs, cluster.decodes, *rflags, policy="kv_aware", name=f"router-{rule}")
        time.sleep(3)  # the routers subscribe to the KV events and scrape the workers once
        results = {}
        print(
            f"{args.model}: {args.requests} requests per rule at {args.rate}/s, {args.output_tokens} output tokens each"
        )
        print(f"{'rule':8} {'short p50/p99 ms':>16} {'multi-turn':>16} {'long':>16} {'KV MiB':>7} fail  placements")
        for i, rule in enumerate(args.rules):
            items = workload(args.requests, 100 + i, vocab)
            before = bytes_sent(cluster)
            t0 = time.monotonic()
            out = asyncio.run(run_rule(routers[rule].url, items, args.rate, args.output_tokens, 200 + i, vocab))
            out["seconds"] = time.monotonic() - t0
            out["kv_bytes"] = bytes_sent(cluster) - before
            out["placements"] = {
                f"{labels['path']}/{labels['reason']}": v
                for labels, v in samples(routers[rule].url, "tandem_router_placement_total")
            }
            results[rule] = out
            t = out["ttft"]
            print(
                f"{rule:8} {quantiles(t['short']):>16} {quantiles(t['multi-turn']):>16} {quantiles(t['long']):>16} "
                f"{out['kv_bytes'] / 2**20:7.1f} {out['failed']:4d}  {out['placements']}",
                flush=True,
            )
            cluster.wait_idle()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        for r in routers.values():
            r.stop()
        cluster.stop()


if __name__ == "__main__":
    main()

"""`tandem bench`: build the workload, find out each endpoint's dialect, run the sweep, report."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from tandem.bench.endpoint import Endpoint, connect
from tandem.bench.multiturn import build_conversations
from tandem.bench.report import document, print_report, write_json
from tandem.bench.runner import Plan, RunResult, make_session, sweep
from tandem.bench.tokenizer import load_tokenizer
from tandem.bench.workload import BenchRequest, Workload, arrival_times, build_workload

WARMUP_OUTPUT_LEN = 16
PROBE_LEN = 8


def make_plans(ns: argparse.Namespace, workload: Workload) -> list[Plan]:
    """One plan per --request-rate, each with newly generated prompts (a jsonl file's repeat): a server's
    prefix cache keeps the prompts of the previous rate, which would otherwise make every later rate look
    faster. Warm-up prompts are fresh too, so warming up plants no cache hit."""
    plans = []
    for rate in ns.request_rate:
        if ns.dataset_name == "multi-turn":
            conversations = build_conversations(ns, workload)
            first = workload.request(conversations[0].first, conversations[0].output_len)
            requests, arrivals = [], arrival_times(len(conversations), rate, ns.seed)
        else:
            conversations, requests = None, build_workload(ns, workload)
            first, arrivals = requests[0], arrival_times(len(requests), rate, ns.seed)
        warmup = workload.random(
            ns.warmup_requests, len(first.prompt_ids), min(first.output_len, WARMUP_OUTPUT_LEN), 1.0
        )
        plans.append(Plan(rate, requests, arrivals, warmup, conversations, ns.mt_think_time_s))
    return plans


async def _measure(
    ns: argparse.Namespace, plans: list[Plan], workload: Workload, probe: BenchRequest
) -> list[RunResult]:
    targets = [(ns.base_url, ns.label)] + ([(ns.compare, ns.compare_label)] if ns.compare else [])
    async with make_session(ns.api_key, ns.request_timeout_s) as session:
        endpoints = []
        for url, label in targets:
            wanted = Endpoint(
                url,
                ns.backend,
                ns.model,
                token_ids=ns.backend != "openai-chat",
                ignore_eos=not ns.disable_ignore_eos,
                extra=ns.extra_request_body,
                label=label,
            )
            endpoints.append(await connect(session, wanted, probe))
        return await sweep(
            session, endpoints, plans, workload, ns.max_concurrency, dict(ns.goodput), not ns.disable_tqdm
        )


def run_bench(ns: argparse.Namespace) -> dict[str, Any]:
    """Run `tandem bench` as parsed by add_bench_flags; print the table, write --output-json and --plot;
    return the JSON document."""
    workload = Workload(load_tokenizer(ns.tokenizer), ns.seed)
    plans = make_plans(ns, workload)
    probe = workload.random(1, PROBE_LEN, 1, 1.0)[0]  # asks a /v1/completions server whether it takes token ids
    runs = asyncio.run(_measure(ns, plans, workload, probe))
    doc = document(ns, runs)
    print_report(doc)
    if ns.output_json:
        write_json(ns.output_json, doc)
    if ns.plot:
        from tandem.bench.plot import plot

        plot(runs, ns.plot)
    return doc

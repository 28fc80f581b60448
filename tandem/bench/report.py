"""Results as a table on the terminal and as one JSON document (--output-json): every run, and for
--compare the ratios compare/base of every number at each request rate."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.bench.runner import RunResult
from tandem.bench.stats import LATENCIES, PERCENTILES

LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e_latency": "E2E latency"}
ROWS = [  # (label, key) of the table, in the order SGLang's bench_serving prints them
    ("Successful requests", "completed"),
    ("Failed requests", "failed"),
    ("Benchmark duration (s)", "duration"),
    ("Total input tokens", "total_input_tokens"),
    ("Total generated tokens", "total_output_tokens"),
    ("Cached prompt tokens", "total_cached_tokens"),
    ("Request throughput (req/s)", "request_throughput"),
    ("Request goodput (req/s)", "request_goodput"),
    ("SLO attainment", "slo_attainment"),
    ("Input token throughput (tok/s)", "input_throughput"),
    ("Output token throughput (tok/s)", "output_throughput"),
    ("Total token throughput (tok/s)", "total_throughput"),
] + [
    (f"{stat.capitalize()} {LATENCY_LABELS[name]} (ms)", f"{stat}_{name}_ms")
    for name in LATENCIES
    for stat in ("mean", *(f"p{q}" for q in PERCENTILES))
]


TURN_ROWS = [  # (label, key) of each turn's rows in a multi-turn run
    ("cached prompt tokens", "cached_tokens"),
    ("decode cached tokens", "decode_cached_tokens"),
    ("mean TTFT (ms)", "mean_ttft_ms"),
    *((f"P{q} TTFT (ms)", f"p{q}_ttft_ms") for q in PERCENTILES),
]


def rate_label(rate: float) -> str | float:
    """A request rate for people and for JSON (which has no infinity)."""
    return "inf" if math.isinf(rate) else rate


def record(run: RunResult, details: bool) -> dict[str, Any]:
    """One run as JSON: where, how, and its numbers (plus each request's with --output-details)."""
    ep = run.endpoint
    rec = {
        "label": ep.name,
        "base_url": ep.base_url,
        "backend": ep.backend,
        "model": ep.model,
        "prompt_format": "token_ids" if ep.token_ids else "text",
        "request_rate": rate_label(run.request_rate),
        "max_concurrency": run.max_concurrency,
        "num_prompts": len(run.outputs),
    } | run.summary
    if details:
        rec["requests"] = [asdict(o) for o in run.outputs]
    return rec


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other/base for every number of the table; None where base is 0 or either is missing."""
    out = {}
    for _, key in ROWS:
        a, b = base.get(key), other.get(key)
        out[key] = b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
    return out


def comparisons(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each request rate with two endpoints: base, compare and their ratios."""
    out = []
    for base, other in zip(records[::2], records[1::2]):
        out.append(
            {
                "request_rate": base["request_rate"],
                "base_url": base["base_url"],
                "compare_url": other["base_url"],
                "ratios": ratios(base, other),
            }
        )
    return out


def document(ns: argparse.Namespace, runs: list[RunResult]) -> dict[str, Any]:
    """The whole --output-json document: the command's settings (no API key), runs, comparisons."""
    config = {k: v for k, v in vars(ns).items() if k not in ("api_key", "command")}
    config["request_rate"] = [rate_label(r) for r in ns.request_rate]
    config["goodput"] = dict(ns.goodput)
    records = [record(r, ns.output_details) for r in runs]
    return {"config": config, "runs": records, "comparisons": comparisons(records) if ns.compare else []}


def write_json(path: str, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_table(records: list[dict[str, Any]], compared: dict[str, Any] | None = None) -> None:
    """One run, or two side by side with their ratio: the runs of one request rate."""
    first = records[0]
    print(f"\n=== request rate {first['request_rate']} req/s, max concurrency {first['max_concurrency'] or '-'} ===")
    header = [""] + [r["label"] for r in records] + (["ratio"] if compared else [])
    width = max(16, *(len(h) + 2 for h in header[1:]))
    print(f"{header[0]:<34}" + "".join(f"{h:>{width}}" for h in header[1:]))
    for label, key in ROWS:
        if all(r.get(key) is None for r in records):
            continue
        cells = [_cell(r.get(key)) for r in records] + ([_cell(compared["ratios"][key])] if compared else [])
        print(f"{label:<34}" + "".join(f"{c:>{width}}" for c in cells))
    _print_turns(records, width)
    for r in records:
        if "first_error" in r:
            print(f"{r['label']}: first error: {r['first_error']}")


def _print_turns(records: list[dict[str, Any]], width: int) -> None:
    """A multi-turn run's rows per turn, the runs side by side."""
    turns = max((len(r.get("turns") or []) for r in records), default=0)
    for i in range(turns):
        for label, key in TURN_ROWS:
            cells = [_cell(r["turns"][i].get(key) if i < len(r.get("turns") or []) else None) for r in records]
            if all(c == "-" for c in cells):
                continue  # e.g. decode cached tokens from a server that is not a PD decode
            print(f"{f'Turn {i + 1} {label}':<34}" + "".join(f"{c:>{width}}" for c in cells))


def print_report(doc: dict[str, Any]) -> None:
    runs, compared = doc["runs"], doc["comparisons"]
    if compared:
        for i, c in enumerate(compared):
            print_table(runs[2 * i : 2 * i + 2], c)
    else:
        for r in runs:
            print_table([r])

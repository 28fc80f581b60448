"""TTFT added by PD (router -> prefill + decode) over a monolithic server, at concurrency 1, with the
per-request timeline that says where the difference goes.

Starts a monolithic server and a PD cluster (one prefill, one decode, the router) side by side with
their request timelines on (TANDEM_LOG_LEVEL=DEBUG, see common/engine/timeline.py), sends the same
fresh random prompts to both, one request at a time, alternating which goes first, and prints the
median TTFT of each at every prompt length with their ratio and difference; then, per length, the
median time from the client's send to every step of the PD request (both halves on one clock: all
processes run on this host) and of the monolithic one.

    .venv/bin/python benchmarks/pd_ttft.py [--backend mooncake] [--repeat 30] [--lengths 16 64 512] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.pd_vs_monolithic import chunk_arrivals  # noqa: E402
from common.engine.timeline import parse  # noqa: E402
from tests.conftest import ServerProcess, start_server  # noqa: E402
from tests.integration.cluster import start_cluster  # noqa: E402

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "512", "--max-total-tokens", "65536")
Sample = dict  # rid, length, send, first (client clock), ttft


def first_token(client: httpx.Client, url: str, rid: str, ids: list[int]) -> Sample:
    """Stream one request; the client's send time and the arrival of its first token (time.monotonic())."""
    body = {"rid": rid, "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    send, arrivals = chunk_arrivals(client, url, body)
    first = arrivals[0]
    return {"rid": rid, "length": len(ids), "send": send, "first": first, "ttft": first - send}


def measure(mono: str, pd: str, lengths: list[int], repeat: int, seed: int) -> dict[str, list[Sample]]:
    rng = random.Random(seed)
    out: dict[str, list[Sample]] = {"mono": [], "pd": []}
    with httpx.Client() as client:
        for name, url in (("mono", mono), ("pd", pd)):  # warm-up: first requests pay one-off costs
            for i in range(3):
                first_token(client, url, f"warmup-{name}-{i}", [rng.randrange(100, 40000) for _ in range(16)])
        for length in lengths:
            for i in range(repeat):
                ids = [rng.randrange(100, 40000) for _ in range(length)]  # new to both servers' prefix caches
                order = [("mono", mono), ("pd", pd)][:: 1 if i % 2 else -1]
                for name, url in order:
                    out[name].append(first_token(client, url, f"{name}-{length}-{i}-{seed}", ids))
    return out


def timelines(*servers: ServerProcess) -> dict[str, dict[str, list[tuple[str, float]]]]:
    """rid -> server name -> [(event, monotonic time)] from the servers' DEBUG timeline lines."""
    found: dict[str, dict[str, list[tuple[str, float]]]] = {}
    for server in servers:
        for line in server.log_path.read_text(errors="replace").splitlines():
            parsed = parse(line)
            if parsed is not None:
                found.setdefault(parsed[0], {})[server.name] = parsed[2]
    return found


def breakdown(samples: list[Sample], lines: dict, length: int) -> list[tuple[str, float]]:
    """(step, median ms after the client's send) for the samples of one length, in time order."""
    offsets: dict[str, list[float]] = {}
    for s in samples:
        if s["length"] != length:
            continue
        steps = [("client_send", s["send"]), ("client_first_token", s["first"])]
        for server, events in lines.get(s["rid"], {}).items():
            steps += [(f"{server}.{name}", at) for name, at in events]
        for name, at in steps:
            offsets.setdefault(name, []).append(1000 * (at - s["send"]))
    return sorted(((name, statistics.median(v)) for name, v in offsets.items()), key=lambda x: x[1])


def outside_forward(sample: Sample, lines: dict) -> float | None:
    """TTFT less the prompt's forward pass(es) (first start to last end, on the server that ran them):
    what PD adds without the model's compute, which on a shared CPU varies more than the rest."""
    for events in lines.get(sample["rid"], {}).values():
        times = dict(events)  # the last occurrence of each event
        start = next((at for name, at in events if name == "prefill_start"), None)
        if start is not None and "forward_done" in times:
            return sample["ttft"] - (times["forward_done"] - start)
    return None


def medians_ms(samples: list[Sample], length: int, value) -> float:
    return statistics.median(1000 * v for s in samples if s["length"] == length and (v := value(s)) is not None)


def report(results: dict[str, list[Sample]], lines: dict, lengths: list[int]) -> dict:
    table = []
    print(f"\n{'prompt tokens':>13} {'monolithic ms':>14} {'PD ms':>8} {'PD/mono':>8} {'PD - mono ms':>13}"
          f" {'outside the forward: mono':>26} {'PD':>6} {'PD - mono':>10}   (ms, median of {len(results['pd']) // len(lengths)})")
    for length in lengths:
        m, p = (medians_ms(results[name], length, lambda s: s["ttft"]) for name in ("mono", "pd"))
        mo, po = (medians_ms(results[name], length, lambda s: outside_forward(s, lines)) for name in ("mono", "pd"))
        table.append({"length": length, "mono_ms": m, "pd_ms": p, "ratio": p / m, "added_ms": p - m,
                      "mono_outside_forward_ms": mo, "pd_outside_forward_ms": po, "added_outside_forward_ms": po - mo})
        print(f"{length:13d} {m:14.1f} {p:8.1f} {p / m:8.2f} {p - m:+13.1f} {mo:26.1f} {po:6.1f} {po - mo:+10.1f}")
    steps = {}
    for length in lengths:
        for name in ("pd", "mono"):
            rows = breakdown(results[name], lines, length)
            steps[f"{name}-{length}"] = rows
            print(f"\n{name}, {length}-token prompt: median ms after the client's send (step, +since previous)")
            prev = 0.0
            for step, ms in rows:
                print(f"  {ms:8.2f}  {ms - prev:+7.2f}  {step}")
                prev = ms
    return {"ttft": table, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="mooncake")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 512])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the table and the steps here")
    ns = ap.parse_args()
    os.environ["TANDEM_LOG_LEVEL"] = "DEBUG"  # the servers log one timeline line per request
    mono = start_server(*FLAGS, name="ttft-mono").wait_ready()
    pd = None
    try:
        pd = start_cluster(ns.backend, flags=FLAGS)
        results = measure(mono.url, pd.url, ns.lengths, ns.repeat, ns.seed)
        time.sleep(0.5)  # the last timeline lines are written as the streams close
        out = report(results, timelines(mono, *pd.prefills, *pd.decodes), ns.lengths)
    finally:
        if pd is not None:
            pd.stop()
        mono.stop()
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

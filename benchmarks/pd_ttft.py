"""TTFT added by PD (router -> prefill + decode) over a monolithic server, at concurrency 1, with the
per-request timeline that says where the difference goes.

Starts a monolithic server, a PD cluster (one prefill, one decode, the router) and a second monolithic
server (the control) side by side with their request timelines on (TANDEM_LOG_LEVEL=DEBUG, see
common/core/timeline.py), sends the same fresh random prompts to all three, one request at a time,
rotating which goes first, and prints the median TTFT of each at every prompt length with PD's ratio
and difference to the first monolithic server; then, per length, the median time from the client's send
to every step of the PD request (both halves on one clock: all processes run on this host) and of the
monolithic one. The control differs from the first monolithic server only by being another process: its
difference is what two identical servers' forwards differ by on this machine, the noise in PD's total.

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
from common.core.timeline import parse  # noqa: E402
from tests.conftest import ServerProcess, start_server  # noqa: E402
from tests.integration.cluster import start_cluster  # noqa: E402

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "512", "--max-total-tokens", "65536")
Sample = dict  # rid, length, send, first (client clock), ttft


def first_token(client: httpx.Client, url: str, rid: str, ids: list[int]) -> Sample:
    """Stream one request; the client's send time and the arrival of its first token (time.monotonic())."""
    body = {
        "rid": rid,
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
    }
    send, arrivals = chunk_arrivals(client, url, body)
    first = arrivals[0]
    return {"rid": rid, "length": len(ids), "send": send, "first": first, "ttft": first - send}


def measure(urls: dict[str, str], lengths: list[int], repeat: int, seed: int) -> dict[str, list[Sample]]:
    """Samples per endpoint name in `urls`: every prompt to each endpoint, the first to go rotating."""
    rng = random.Random(seed)
    out: dict[str, list[Sample]] = {name: [] for name in urls}
    endpoints = list(urls.items())
    with httpx.Client() as client:
        for name, url in endpoints:  # warm-up: first requests pay one-off costs
            for i in range(3):
                first_token(client, url, f"warmup-{name}-{i}", [rng.randrange(100, 40000) for _ in range(16)])
        for length in lengths:
            for i in range(repeat):
                ids = [rng.randrange(100, 40000) for _ in range(length)]  # new to every server's prefix cache
                k = i % len(endpoints)
                for name, url in endpoints[k:] + endpoints[:k]:
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
    print(
        f"\n{'prompt tokens':>13} {'monolithic ms':>14} {'PD ms':>8} {'PD/mono':>8} {'PD - mono ms':>13}"
        f" {'control - mono ms':>18} {'outside the forward: mono':>26} {'PD':>6} {'PD - mono':>10} {'control - mono':>15}"
        f"   (ms, median of {len(results['pd']) // len(lengths)})"
    )
    for length in lengths:
        m, p, c = (medians_ms(results[name], length, lambda s: s["ttft"]) for name in ("mono", "pd", "control"))
        mo, po, co = (
            medians_ms(results[name], length, lambda s: outside_forward(s, lines)) for name in ("mono", "pd", "control")
        )
        table.append(
            {
                "length": length,
                "mono_ms": m,
                "pd_ms": p,
                "ratio": p / m,
                "added_ms": p - m,
                "control_ms": c,
                "control_added_ms": c - m,
                "mono_outside_forward_ms": mo,
                "pd_outside_forward_ms": po,
                "added_outside_forward_ms": po - mo,
                "control_added_outside_forward_ms": co - mo,
            }
        )
        print(
            f"{length:13d} {m:14.1f} {p:8.1f} {p / m:8.2f} {p - m:+13.1f} {c - m:+18.1f} {mo:26.1f} {po:6.1f} {po - mo:+10.1f}"
            f" {co - mo:+15.1f}"
        )
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
    control = pd = None
    try:
        control = start_server(*FLAGS, name="ttft-control").wait_ready()
        pd = start_cluster(ns.backend, flags=FLAGS)
        results = measure({"mono": mono.url, "pd": pd.url, "control": control.url}, ns.lengths, ns.repeat, ns.seed)
        time.sleep(0.5)  # the last timeline lines are written as the streams close
        out = report(results, timelines(mono, control, *pd.prefills, *pd.decodes), ns.lengths)
    finally:
        for cluster in (pd, control):
            if cluster is not None:
                cluster.stop()
        mono.stop()
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""The planner against a shifting workload (docs/placement.md): three servers (`--model`) that may switch
roles (--enable-pd-role-switch) behind one router, and a workload that shifts after --phase-s seconds from long
prompts and short outputs (phase 1) to short prompts and long outputs (phase 2), requests arriving as a Poisson
process. Three runs over the same servers and the same arrival times (kept to the clock, so a client slowed by
its own streams does not thin them), fresh prompts each:

    static 2P1D    the split phase 1 wants, kept
    static 1P2D    the split phase 2 wants, kept
    planner        2P1D at the start, `tandem planner --mode sla` with the targets below flipping servers

Per run: SLO attainment (requests whose TTFT and TPOT both met --ttft-ms / --tpot-ms) per phase and overall,
failed requests, and for the planner when it flipped (seconds and intervals after the shift), when after the shift
its decode pressure first went over 1 (tandem_planner_pressure, read with the split), and what it decided.

    .venv/bin/python benchmarks/planner_bench.py [--phase-s 60] [--ttft-ms 3000] [--tpot-ms 100] [--rates 0.5 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.placement_bench import bench_model, samples, stream  # noqa: E402
from tests.conftest import ServerProcess, start_server  # noqa: E402
from tests.integration.cluster import Cluster  # noqa: E402
from tests.ports import free_port  # noqa: E402

PHASES = {1: {"prompt": 1536, "output": 8, "rate": 0.5}, 2: {"prompt": 64, "output": 128, "rate": 1.5}}
FLAGS = ("--page-size", "16", "--chunked-prefill-size", "256", "--max-total-tokens", "16384",
         "--enable-pd-role-switch")  # fmt: skip


def roles(url: str) -> dict[str, str]:
    return {w["url"]: w["role"] for w in httpx.get(url + "/workers", timeout=10).json()["workers"]}


def set_split(c: Cluster, prefills: int) -> None:
    """The first `prefills` servers prefill, the others decode (switched through the router)."""
    for i, server in enumerate(c.nodes):
        role = "prefill" if i < prefills else "decode"
        if roles(c.url)[server.url] != role:
            r = httpx.post(c.url + "/pd_role_switch", json={"url": server.url, "new_role": role}, timeout=600)
            assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(c.url + "/readiness", timeout=5).status_code != 200:
        time.sleep(0.5)


ARRIVALS_SEED = 299


def arrivals(phase_s: float) -> list[tuple[int, float]]:
    """(phase, seconds after the start) of every request: a Poisson process at each phase's rate, the same for
    every run."""
    rng, out = random.Random(ARRIVALS_SEED), []
    for phase in (1, 2):
        t = (phase - 1) * phase_s
        while (t := t + rng.expovariate(PHASES[phase]["rate"])) < phase * phase_s:
            out.append((phase, t))
    return out


async def run(url: str, phase_s: float, seed: int, ttft_s: float, tpot_s: float, vocab: int, watch=None) -> dict:
    rng = random.Random(seed)  # the prompts'
    results: list[tuple[int, float | None, float | None]] = []

    async def one(phase: int, client: httpx.AsyncClient) -> None:
        p = PHASES[phase]
        prompt = [rng.randrange(vocab - 1) for _ in range(p["prompt"])]
        ttft, tpot, _ = await stream(client, url, prompt, p["output"])
        results.append((phase, ttft, tpot))

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=900) as client:
        watching = asyncio.create_task(watch(client, start)) if watch is not None else None
        tasks = []
        for phase, at in arrivals(phase_s):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))  # late: at once
            tasks.append(asyncio.create_task(one(phase, client)))
        await asyncio.gather(*tasks)
        if watching is not None:
            watching.cancel()
    met = {1: [0, 0], 2: [0, 0]}
    failed = 0
    for phase, ttft, tpot in results:
        failed += ttft is None
        met[phase][1] += 1
        met[phase][0] += ttft is not None and ttft <= ttft_s and (tpot is None or tpot <= tpot_s)
    latency = {
        phase: {
            "ttft_p50_ms": _p([t for ph, t, _ in results if ph == phase and t is not None], 0.5),
            "tpot_p90_ms": _p([t for ph, _, t in results if ph == phase and t is not None], 0.9),
        }
        for phase in (1, 2)
    }
    return {"met": met, "failed": failed, "requests": len(results), "latency": latency}


def decode_pressure(answer: httpx.Response) -> float:
    """The planner's decode pressure in its /metrics answer."""
    for family in text_string_to_metric_families(answer.text):
        for x in family.samples:
            if x.name == "tandem_planner_pressure" and x.labels.get("worker_role") == "decode":
                return x.value
    return 0.0


def _p(xs: list[float], q: float) -> float | None:
    return round(1000 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]) if xs else None


def share(met: list[int]) -> str:
    return f"{100 * met[0] / met[1]:5.1f}% of {met[1]:3d}" if met[1] else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-s", type=float, default=60)
    ap.add_argument("--ttft-ms", type=float, default=3000)
    ap.add_argument("--tpot-ms", type=float, default=100)
    ap.add_argument("--interval-s", type=float, default=3)
    ap.add_argument("--rates", type=float, nargs=2, metavar=("PHASE1", "PHASE2"),
                    help="requests per second of each phase (default: PHASES')")  # fmt: skip
    ap.add_argument("--runs", nargs="+", default=["2P1D", "1P2D", "planner"])
    ap.add_argument("--model", default="small", help="builtin, small (benchmarks/placement_bench.py) or a path")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one torch thread per server: several share a few cores
    model, args.vocab = bench_model(args.model)
    for phase, rate in zip((1, 2), args.rates or ()):
        PHASES[phase]["rate"] = rate
    c = Cluster(policy="power_of_two", router_args=("--health-check-interval-s", "0.5"))
    try:
        for name, mode in (("p0", "prefill"), ("s1", "prefill"), ("d2", "decode")):
            flags = ("--model", model, "--bootstrap-port", str(free_port()), *FLAGS)
            server = start_server("--disaggregation-mode", mode, *flags, name=name)
            (c.prefills if mode == "prefill" else c.decodes).append(server)
        c.spawn_router()
        c.wait_ready(900)
        print(f"phases of {args.phase_s:g} s: {PHASES}; targets TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms")
        print(f"{'run':8} {'phase 1 met':>14} {'phase 2 met':>14} {'overall':>14} failed  flips")
        results = {}
        for i, name in enumerate(args.runs):
            set_split(c, 1 if name == "1P2D" else 2)
            results[name] = one_run(c, name, args, seed=300 + i)
            r = results[name]
            total = [r["met"][1][0] + r["met"][2][0], r["met"][1][1] + r["met"][2][1]]
            print(
                f"{name:8} {share(r['met'][1]):>14} {share(r['met'][2]):>14} {share(total):>14} {r['failed']:6d}  "
                f"{r.get('flips', '')}  {r['latency']}",
                flush=True,
            )
            c.wait_idle()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        c.stop()


def one_run(c: Cluster, name: str, args, seed: int) -> dict:
    ttft_s, tpot_s = args.ttft_ms / 1000, args.tpot_ms / 1000
    if name != "planner":
        return asyncio.run(run(c.url, args.phase_s, seed, ttft_s, tpot_s, args.vocab))
    port = free_port()
    planner = ServerProcess(
        ["planner", "--router", c.url, "--mode", "sla", "--ttft-ms", str(args.ttft_ms), "--itl-ms",
         str(args.tpot_ms), "--interval-s", str(args.interval_s), "--hysteresis", "2", "--cooldown-s",
         str(4 * args.interval_s), "--port", str(port)],
        port, name="planner-bench", env={"TANDEM_LOG_LEVEL": "DEBUG"},  # every interval's decision in its log
    )  # fmt: skip
    flips: list[str] = []

    def since_shift(what: str, t: float) -> str:
        shift = t - args.phase_s
        return f"{what} at {t:.0f} s ({shift:+.0f} s, {shift / args.interval_s:+.1f} intervals from the shift)"

    async def watch(client: httpx.AsyncClient, start: float) -> None:
        """Every half second, the split the router sees and the planner's decode pressure; each change of split noted
        with its time from the shift, and the first decode pressure over 1 after it."""
        last, pressed = None, False
        while True:
            workers = (await client.get(c.url + "/workers")).json()["workers"]
            split = "".join(sorted(w["role"][0].upper() for w in workers))  # e.g. "DPP"
            t = time.monotonic() - start
            if last is not None and split != last:
                flips.append(since_shift(f"{last}->{split}", t))
            last = split
            if not pressed and t > args.phase_s and decode_pressure(await client.get(planner.url + "/metrics")) > 1:
                pressed = True
                flips.append(since_shift("decode pressure over 1", t))
            await asyncio.sleep(0.5)

    try:
        planner.wait_ready(60)
        out = asyncio.run(run(c.url, args.phase_s, seed, ttft_s, tpot_s, args.vocab, watch))
        out["decisions"] = {
            f"{labels['action']}/{labels['reason']}": v
            for labels, v in samples(planner.url, "tandem_planner_decisions_total")
        }
    finally:
        planner.stop()
    out["flips"] = "; ".join(flips) or "none"
    out["planner_log"] = str(planner.log_path)  # every interval's pressures and decision
    return out


if __name__ == "__main__":
    main()

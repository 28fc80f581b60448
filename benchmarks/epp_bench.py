"""`tandem epp` behind Envoy, measured (docs/performance.md):

1. the latency the picker adds: one monolithic server of the built-in model, one Envoy; 300 requests one at a
   time (a prompt of 8 tokens, 1 new token), alternating between Envoy's listener with the picker (ext_proc, the body
   buffered) and its listener without one (Envoy's round robin), p50 / p99 of each;
2. picks per second one EPP process sustains: a gRPC client opens ext_proc streams (headers + a body of 512 prompt
   ids) to `tandem epp --policy kv_aware` over two servers, 32 at once, for 10 s;
3. cache hits of a multi-turn load: 2 prefills + 2 decodes publishing KV events, `tandem bench` multi-turn (8
   conversations x 4 turns) through `tandem router --policy kv_aware`, then (another seed) through Envoy +
   `tandem epp --policy kv_aware` + a pair sidecar per decode.

    .venv/bin/python benchmarks/epp_bench.py [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.kv_routing import EVENTS, PAGE, bench, oracle  # noqa: E402
from tests.conftest import ServerProcess, free_port, start_server  # noqa: E402
from tests.integration.cluster import start_cluster  # noqa: E402
from tests.integration.gateway import Envoy, epp_address, start_epp  # noqa: E402

FLAGS = ("--page-size", str(PAGE), "--chunked-prefill-size", "512", "--kv-events-config", EVENTS)


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if q < 100 else max(xs)


def latency(tmp: Path, n: int = 300) -> dict:
    server = start_server(*FLAGS, name="epp-bench-mono").wait_ready(300)
    epp = start_epp("--worker", server.url, policy="kv_aware")
    envoy = Envoy(epp_address(epp), [server.url.removeprefix("http://")], [], tmp).wait_ready(60)
    body = {"input_ids": list(range(10, 18)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    times: dict[str, list[float]] = {"fail_close": [], "direct": []}
    try:
        with httpx.Client(timeout=60) as client:
            for i in range(n + 20):
                for name in times:
                    start = time.perf_counter()
                    r = client.post(envoy.listener(name) + "/generate", json=body)
                    assert r.status_code == 200, r.text
                    if i >= 20:  # warm-up
                        times[name].append(1000 * (time.perf_counter() - start))
    finally:
        envoy.stop(), epp.stop(), server.stop()
    out = {k: (percentile(v, 50), percentile(v, 99)) for k, v in times.items()}
    return {"with_epp_ms": out["fail_close"], "without_epp_ms": out["direct"], "requests": n}


async def _picks(grpc_target: str, seconds: float, concurrency: int) -> int:
    import grpc
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/generate")]))
    )
    data = json.dumps({"input_ids": list(range(1000, 1512)), "sampling_params": {"max_new_tokens": 8}}).encode()
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))
    done = 0
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        stub = ExternalProcessorStub(channel)
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                answers = [a async for a in stub.Process(iter([headers, body]))]
                assert answers[-1].WhichOneof("response") == "request_body"
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def picks_per_second(seconds: float = 10.0, concurrency: int = 32) -> dict:
    servers = [start_server(*FLAGS, name=f"epp-bench-pick{i}") for i in range(2)]
    try:
        for s in servers:
            s.wait_ready(300)
        epp = start_epp(*(a for s in servers for a in ("--worker", s.url)), policy="kv_aware")
        try:
            done = asyncio.run(_picks(epp_address(epp), seconds, concurrency))
        finally:
            epp.stop()
    finally:
        for s in servers:
            s.stop()
    return {"picks_per_s": done / seconds, "concurrency": concurrency}


def hit_rate(run: dict) -> tuple[float, float]:
    prompt = sum(t["input_tokens"] for t in run["turns"])
    prefill = sum(t["cached_tokens"] or 0 for t in run["turns"]) / prompt
    return prefill, sum(t["decode_cached_tokens"] or 0 for t in run["turns"]) / prompt


def cache_hits(tmp: Path) -> dict:
    cluster = start_cluster("mooncake", n_prefill=2, n_decode=2, flags=FLAGS, policy="kv_aware", ready_timeout=900)
    sidecars, epp, envoy = [], None, None
    try:
        time.sleep(3)  # the router's feeds subscribe
        router_run = bench(cluster.url, 2000, tmp / "router.json")
        for d in cluster.decodes:
            port = free_port()
            args = ["sidecar", "--decode", d.url, "--port", str(port), "--host", "127.0.0.1"]
            sidecars.append(ServerProcess(args, port, name="epp-bench-sidecar").wait_ready(60))
        pairs = [
            a for p, b in zip(cluster.prefills, cluster.prefill_bootstrap_ports) for a in ("--prefill", p.url, str(b))
        ]
        decodes = [a for s in sidecars for a in ("--decode", s.url)]
        epp = start_epp(*pairs, *decodes, policy="kv_aware")
        pool = [s.url.removeprefix("http://") for s in sidecars]
        envoy = Envoy(epp_address(epp), pool, pool, tmp).wait_ready(60)
        time.sleep(3)  # the picker's feeds subscribe
        epp_run = bench(envoy.listener("fail_close"), 3000, tmp / "epp.json")
    finally:
        for p in [envoy, epp, *sidecars]:
            if p is not None:
                p.stop()
        cluster.stop()
    return {
        "router_prefill_decode_hit": hit_rate(router_run),
        "epp_prefill_decode_hit": hit_rate(epp_run),
        "oracle": oracle(),
        "failed": [sum(t["failed"] for t in r["turns"]) for r in (router_run, epp_run)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", nargs="+", default=["latency", "picks", "hits"], choices=["latency", "picks", "hits"])
    ns = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "latency" in ns.parts:
            results["latency"] = latency(Path(tmp))
            print(json.dumps(results["latency"]), flush=True)
        if "picks" in ns.parts:
            results["picks"] = picks_per_second()
            print(json.dumps(results["picks"]), flush=True)
        if "hits" in ns.parts:
            results["hits"] = cache_hits(Path(tmp))
            print(json.dumps(results["hits"]), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The zero-loss drill (docs/migration.md): N streams through a 1P2D and a 2P2D cluster (Mooncake TCP, KV
checksums on, a tiny random Llama unless --model says otherwise), once without faults and once while faults
hit the cluster: a decode killed at a random token (twice, each restarted), a dropped KV write and a flipped
byte (a fault-injecting transport on prefill0: tests/integration/kv_faults.py), and prefill0 killed while
requests wait on it (restarted; on 1P2D the decodes run --kv-load-failure-policy recompute: they compute
the prompts themselves). After a kill no new stream starts until the server is back (those running go on):
each fault hits a cluster with another healthy pair. Half the streams are greedy, half seeded sampling, each
with its own prompt (seeded: temperature 0.9, top_k 20, so that its top 20 logprobs are all it draws from).

Prints, per topology: streams completed and byte-identical to the no-fault run (tokens, text and
logprobs), moves by reason, the resume gap (router histogram, interpolated p50/p99), each stream's longest
gap between events (p50/p99, with and without faults), KV bytes sent by the prefills per move beyond the
no-fault run's, corrupted rooms caught, and client retries (a 503 before any byte while no pair is healthy).

    .venv/bin/python benchmarks/migration_drill.py [--streams 200] [--topologies 1p2d 2p2d] [--max-new 48]
        [--concurrency 24] [--model builtin] [--enable-deterministic-inference]

With --enable-deterministic-inference on every server a stream's bits do not follow its batch, so there is
no near-tie to excuse: the near-tie row is left out, and every stream must be identical to the no-fault run.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.stream_compare import ok, parting, same  # noqa: E402
from tests.conftest import ServerProcess, free_port, metric  # noqa: E402
from tests.integration.cluster import spawn_router  # noqa: E402
from tests.integration.kv_faults import arm, site_env  # noqa: E402
from tests.integration.tiny_model import save_tiny_llama  # noqa: E402

ENGINE = ("--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "16384")
PD = ("--disaggregation-enable-kv-checksum", "--drain-timeout-s", "2", "--heartbeat-interval-s", "1")
ROUTER = ("--health-check-interval-s", "0.3", "--health-check-timeout-s", "1", "--migration-limit", "3")


class Cluster:
    def __init__(self, model: str, prefills: int, recompute: bool, fault_dir: str, deterministic: bool = False):
        self.faults = [str(Path(fault_dir) / f"prefill{i}") for i in range(prefills)]
        flags = ("--model", model, *ENGINE, *PD, *(("--enable-deterministic-inference",) if deterministic else ()))
        self.prefills, self.decodes = [], []
        for i, path in enumerate(self.faults):
            Path(path).write_text("")
            port, boot = free_port(), free_port()
            args = [
                "serve",
                "--port",
                str(port),
                "--disaggregation-mode",
                "prefill",
                "--bootstrap-port",
                str(boot),
                *flags,
            ]
            self.prefills.append(ServerProcess(args, port, name=f"drill-prefill{i}", env=site_env(path)))
        policy = ("--kv-load-failure-policy", "recompute") if recompute else ()
        for j in range(2):
            port = free_port()
            args = ["serve", "--port", str(port), "--disaggregation-mode", "decode", *flags, *policy]
            self.decodes.append(ServerProcess(args, port, name=f"drill-decode{j}"))
        for s in self.servers:
            s.wait_ready(600)
        pairs = [(p, int(p.arg("--bootstrap-port"))) for p in self.prefills]
        self.router = spawn_router(pairs, self.decodes, *ROUTER, name="drill-router").wait_ready(120)
        for s in self.servers:
            self.wait_in_rotation(s)

    @property
    def servers(self) -> list[ServerProcess]:
        return self.prefills + self.decodes

    def wait_in_rotation(self, server: ServerProcess, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = httpx.get(self.router.url + "/workers", timeout=5).json()["workers"]
            if any(w["url"] == server.url and w["healthy"] for w in workers):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{server.name} not back in rotation")

    def restart(self, server: ServerProcess) -> None:
        server.restart().wait_ready(600)
        self.wait_in_rotation(server)

    def bytes_sent(self) -> float:
        return sum(metric(p.url, "tandem_kv_transfer_events_total", event="bytes_sent") for p in self.prefills)

    def stop(self) -> None:
        for s in [self.router, *self.servers]:
            s.stop()


def bodies(n: int, max_new: int, seed: int = 0) -> list[dict]:
    """Half greedy, half seeded sampling; every prompt its own (so caches do not make the drill easy)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(24, 160))]  # the tiny model's vocabulary: 512
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_k": 20, "seed": 1000 + i}
        out.append(
            {
                "input_ids": prompt,
                "stream": True,
                "return_logprob": True,
                # where a stream parts from its no-fault run, what it drew from (benchmarks/stream_compare.py)
                "top_logprobs_num": sampling.get("top_k", 2),
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, **sampling},
            }
        )
    return out


def stream(url: str, body: dict) -> dict:
    """One stream to its end: the last event's tokens, text, logprobs, the longest gap between events;
    503s before any byte (no healthy pair for the moment) are retried after a second, as clients do."""
    retries = 0
    while True:
        events, gaps, last = [], [], None
        error = None
        with httpx.stream("POST", url + "/generate", json=body, timeout=600) as r:
            if r.status_code == 503 and retries < 120:
                r.read()
                retries += 1
                time.sleep(1.0)
                continue
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                gaps.append(now - last) if last is not None else None
                last = now
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                else:
                    events.append(event)
        final = events[-1] if events else {}
        meta = final.get("meta_info", {})
        return {
            "status": r.status_code,
            "error": error,
            "answer": (final.get("output_ids"), final.get("text"), meta.get("output_token_logprobs")),
            "id": meta.get("id"),
            "top": meta.get("output_top_logprobs"),
            "max_gap": max(gaps, default=0.0),
            "retries": retries,
        }


def differences(reqs: list[dict], ref: list[dict], other: list[dict]) -> list[dict]:
    """Each stream of `other` not identical to `ref`'s: where they part and whether that is a float near-tie."""
    return [
        {"stream": i, "id": f["id"], "sampling": "greedy" if b["sampling_params"]["temperature"] == 0 else "seeded"}
        | parting(b, a, f)
        for i, (b, a, f) in enumerate(zip(reqs, ref, other))
        if ok(a) and not same(a, f)
    ]


def run_pass(url: str, reqs: list[dict], concurrency: int, progress: list[int], gate: threading.Event) -> list[dict]:
    """Every request, `concurrency` at a time; a new one starts only while `gate` is open (the injector closes
    it while a killed server restarts: each fault hits a cluster that has another healthy pair)."""

    def one(body: dict) -> dict:
        gate.wait()
        out = stream(url, body)
        progress[0] += 1
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, reqs))


def busiest(decodes: list[ServerProcess]) -> ServerProcess:
    def running(d: ServerProcess) -> int:
        try:
            return d.info()["num_running_reqs"]
        except Exception:
            return -1

    return max(decodes, key=running)


def inject_faults(
    c: Cluster, total: int, progress: list[int], log: list[str], stop: threading.Event, gate: threading.Event
) -> None:
    """The faults, each when its share of the streams has ended; after a kill no new stream starts until the
    server is back (the streams running go on); none once the pass is over."""
    rng = random.Random(1)

    def at(share: float) -> bool:
        while progress[0] < share * total:
            if stop.wait(0.05):
                return False
        return not stop.is_set()

    def restart(server: ServerProcess) -> None:
        gate.clear()
        try:
            c.restart(server)
        finally:
            gate.set()

    def kill_decode(share: float) -> None:
        if at(share):
            time.sleep(rng.uniform(0, 1.0))  # a random token of the streams running then
            victim = busiest([d for d in c.decodes if d.proc.poll() is None])
            victim.signal(signal.SIGKILL)
            log.append(f"SIGKILL {victim.name} after {progress[0]} streams")
            restart(victim)

    kill_decode(0.1)
    for share, fault in ((0.25, "drop"), (0.4, "flip")):
        if at(share):
            arm(c.faults[0], fault)
            log.append(f"armed {fault} on prefill0 after {progress[0]} streams")
    if at(0.55):
        victim = c.prefills[0]
        victim.signal(signal.SIGSTOP)
        time.sleep(0.5)  # requests the router gave it wait there: their KV never lands
        victim.signal(signal.SIGKILL)
        log.append(f"SIGKILL prefill0 (frozen 0.5 s) after {progress[0]} streams")
        restart(victim)
    kill_decode(0.75)


def histogram_quantile(url: str, name: str, q: float) -> float:
    """Prometheus's histogram_quantile over the router's buckets (linear within a bucket)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = []
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if not total:
        return float("nan")
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_le, prev_count = le, count
    return prev_le


class BytesMeter:
    """KV bytes the prefills send, summed over restarts (a restarted prefill's counter starts at 0 again)."""

    def __init__(self, c: Cluster):
        self.c, self.total, self.last = c, 0.0, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            self.sample()

    def sample(self) -> None:
        for p in self.c.prefills:
            try:
                now = metric(p.url, "tandem_kv_transfer_events_total", event="bytes_sent")
            except Exception:
                continue  # down for the moment
            last = self.last.get(p.name, 0.0)
            self.total += now - last if now >= last else now
            self.last[p.name] = now

    def read(self) -> float:
        self.sample()
        return self.total

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def drill(ns: argparse.Namespace, model: str, prefills: int) -> dict:
    with tempfile.TemporaryDirectory() as faults:
        c = Cluster(model, prefills, recompute=prefills == 1, fault_dir=faults, deterministic=ns.deterministic)
        meter = BytesMeter(c)
        try:
            reqs = bodies(ns.streams, ns.max_new)
            gate = threading.Event()
            gate.set()
            clean = run_pass(c.router.url, reqs, ns.concurrency, [0], gate)
            start = meter.read()
            baseline = run_pass(c.router.url, reqs, ns.concurrency, [0], gate)  # caches as warm as the fault pass's
            warm = meter.read() - start
            progress, log, stop = [0], [], threading.Event()
            injector = threading.Thread(target=inject_faults, args=(c, ns.streams, progress, log, stop, gate))
            injector.start()
            start = meter.read()
            faulted = run_pass(c.router.url, reqs, ns.concurrency, progress, gate)
            stop.set()
            injector.join()
            fault_bytes = meter.read() - start
            moves = {
                r: metric(c.router.url, "tandem_router_migrations_total", reason=r)
                for r in ("decode_failed", "prefill_failed", "worker_dead")
            }
            gap = "tandem_router_migration_resume_gap_seconds"
            diffs = differences(reqs, clean, faulted)
            return {
                "topology": f"{prefills}P2D",
                "streams": ns.streams,
                "completed": sum(1 for f in faulted if f["status"] == 200 and f["error"] is None),
                "identical to the no-fault run": sum(1 for a, f in zip(clean, faulted) if ok(a) and same(a, f)),
                "identical to one of the no-fault runs": sum(
                    1 for a, b, f in zip(clean, baseline, faulted) if ok(a) and (same(a, f) or same(b, f))
                ),
                "identical, or parting from it at a float near-tie": ns.streams
                - sum(1 for d in diffs if not d["near_tie"]),
                "no-fault runs identical": sum(1 for a, b in zip(clean, baseline) if ok(a) and same(a, b)),
                "tokens and text identical to the no-fault run": sum(
                    1 for a, f in zip(clean, faulted) if ok(a) and a["answer"][:2] == f["answer"][:2]
                ),
                "moves": moves,
                "corrupted rooms caught": sum(
                    metric(d.url, "tandem_kv_transfer_failures_total", cause="checksum") for d in c.decodes
                ),
                "rooms recomputed": sum(
                    metric(d.url, "tandem_kv_transfer_events_total", event="rooms_recomputed") for d in c.decodes
                ),
                "resume gap p50, p99 s": [histogram_quantile(c.router.url, gap, q) for q in (0.5, 0.99)],
                "longest gap per stream p50, p99 s (no faults)": np.percentile(
                    [b["max_gap"] for b in baseline], [50, 99]
                ).tolist(),
                "longest gap per stream p50, p99 s (faults)": np.percentile(
                    [f["max_gap"] for f in faulted], [50, 99]
                ).tolist(),
                "KV MiB sent, no-fault pass (warm caches)": warm / 2**20,
                "KV MiB sent, fault pass": fault_bytes / 2**20,
                "KV KiB re-sent per move": (fault_bytes - warm) / max(sum(moves.values()), 1) / 2**10,
                "client retries (503 before any byte, no pair)": sum(f["retries"] for f in faulted),
                "faults": log,
                "not identical": diffs,
                "no-fault runs not identical": differences(reqs, clean, baseline),
            }
        finally:
            meter.close()
            c.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--topologies", nargs="+", default=["1p2d", "2p2d"], choices=["1p2d", "2p2d"])
    p.add_argument("--model", default=None, help="default: a tiny random Llama (tests/integration/tiny_model.py)")
    p.add_argument("--enable-deterministic-inference", dest="deterministic", action="store_true")
    ns = p.parse_args()
    model = ns.model or str(save_tiny_llama(Path(tempfile.mkdtemp(prefix="drill-model-"))))
    for topo in ns.topologies:
        r = drill(ns, model, int(topo[0]))
        if ns.deterministic:  # nothing parts at a near-tie: every stream is identical, or the drill fails
            del r["identical, or parting from it at a float near-tie"]
        print(json.dumps(r, indent=1), flush=True)
        if ns.deterministic and (r["not identical"] or r["no-fault runs not identical"]):
            sys.exit(f"{r['topology']}: streams not identical under --enable-deterministic-inference")


if __name__ == "__main__":
    main()

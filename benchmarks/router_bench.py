"""Router throughput: Tandem's router vs sglang-router (Rust, PD mode) in front of the same mock prefill and
decode workers (benchmarks/router_mock.py), 32 clients with keep-alive connections, JSON and streaming.

    .venv/bin/python benchmarks/router_bench.py [--clients 32] [--seconds 5] [--repeat 3] [--events 16]
        [--tandem-args "--workers 2"]

Per repetition each router runs alone (started, measured on every mode, stopped; the order alternates),
so both see the same machine. Every answer is checked byte for byte against the decode's body (neither
router changes it without logprobs); a wrong answer counts as an error, not as throughput. The table
gives the median req/s over the repetitions, the ratio Tandem / sglang-router and each repetition's
numbers; p50 is the median request latency of the median run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.router_mock import bodies  # noqa: E402
from tests.conftest import free_port  # noqa: E402

PROMPT = "Summarise the following text in one sentence. " * 10
MODES = [("/generate", False), ("/generate", True), ("/v1/chat/completions", False), ("/v1/chat/completions", True)]


def request_body(path: str, stream: bool) -> dict:
    if path == "/generate":
        return {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "stream": stream}
    return {"model": "mock", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": stream}


def http_request(port: int, path: str, stream: bool) -> bytes:
    body = json.dumps(request_body(path, stream)).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, keep-alive) of one HTTP/1.1 response: Content-Length or chunked."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip().lower() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
    status = int(lines[0].split(" ")[1])
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        parts = []
        while size := int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
            parts.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")
        body = b"".join(parts)
    return status, body, headers.get("connection") != "close"


@dataclass
class Run:
    done: list[tuple[float, float]] = field(default_factory=list)  # (finished at, latency)
    errors: int = 0
    first_error: str = ""


async def client(port: int, request: bytes, expected: bytes, until: float, run: Run) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            start = time.monotonic()
            writer.write(request)
            status, body, keep_alive = await read_response(reader)
            now = time.monotonic()
            if status == 200 and body == expected:
                run.done.append((now, now - start))
            else:
                run.errors += 1
                run.first_error = run.first_error or f"HTTP {status}: {body[:300]!r}"
            if not keep_alive:
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
    finally:
        writer.close()


async def measure(port: int, path: str, stream: bool, clients: int, seconds: float, warmup: float) -> tuple[float, float, Run]:
    """(req/s, p50 latency in ms, the run) over `seconds` after `warmup` seconds of the same load."""
    expected = b"".join(bodies(ARGS.events)[path, stream])
    run, start = Run(), time.monotonic()
    until = start + warmup + seconds
    await asyncio.gather(*(client(port, http_request(port, path, stream), expected, until, run) for _ in range(clients)))
    counted = [lat for t, lat in run.done if start + warmup <= t <= until]
    p50 = 1000 * statistics.median(counted) if counted else float("nan")
    return len(counted) / seconds, p50, run


def spawn(cmd: list[str], ready_url: str, name: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}: {shlex.join(cmd)}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} not ready after 60 s: {shlex.join(cmd)}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def router_cmd(name: str, port: int, prefill: str, boot: int, decode: str) -> list[str]:
    if name == "tandem":
        return [sys.executable, "-m", "tandem", "router", "--prefill", prefill, str(boot), "--decode", decode,
                "--port", str(port), "--policy", "round_robin", *shlex.split(ARGS.tandem_args)]
    return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill, str(boot),
            "--decode", decode, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--prometheus-port", str(free_port()), *shlex.split(ARGS.sglang_args)]


def bench_router(name: str, prefill: str, boot: int, decode: str) -> dict[tuple[str, bool], tuple[float, float, Run]]:
    port = free_port()
    proc = spawn(router_cmd(name, port, prefill, boot, decode), f"http://127.0.0.1:{port}/readiness", name)
    try:
        return {m: asyncio.run(measure(port, *m, ARGS.clients, ARGS.seconds, ARGS.warmup)) for m in MODES}
    finally:
        stop(proc)


def report(results: dict[str, list[dict]]) -> None:
    print(f"\n{ARGS.clients} clients, {ARGS.seconds:g} s per run after {ARGS.warmup:g} s warm-up, {ARGS.repeat} repetitions, "
          f"{ARGS.events} SSE events per streamed answer, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<28} {'tandem req/s':>12} {'sglang req/s':>12} {'ratio':>6} {'p50 ms t/s':>12}   runs tandem | sglang")
    for path, stream in MODES:
        runs = {n: sorted(results[n], key=lambda r: r[path, stream][0]) for n in results}
        med = {n: r[len(r) // 2][path, stream] for n, r in runs.items()}
        each = {n: " ".join(f"{r[path, stream][0]:.0f}" for r in results[n]) for n in results}
        errors = sum(r[path, stream][2].errors for n in results for r in results[n])
        mode = f"{path} {'stream' if stream else 'json'}"
        print(f"{mode:<28} {med['tandem'][0]:>12.0f} {med['sglang'][0]:>12.0f} {med['tandem'][0] / med['sglang'][0]:>6.2f} "
              f"{med['tandem'][1]:>5.1f}/{med['sglang'][1]:<5.1f}   {each['tandem']} | {each['sglang']}"
              + (f"   ERRORS {errors}" if errors else ""))
    for n in results:
        for r in results[n]:
            for m, (_, _, run) in r.items():
                if run.errors:
                    print(f"{n} {m}: {run.errors} wrong answers, the first: {run.first_error}")


def main() -> None:
    boot, pport, dport = free_port(), free_port(), free_port()
    mock = [sys.executable, str(ROOT / "benchmarks" / "router_mock.py"), "--events", str(ARGS.events)]
    prefill = spawn([*mock, "--role", "prefill", "--port", str(pport)], f"http://127.0.0.1:{pport}/health", "mock prefill")
    decode = spawn([*mock, "--role", "decode", "--port", str(dport)], f"http://127.0.0.1:{dport}/health", "mock decode")
    results: dict[str, list[dict]] = {"tandem": [], "sglang": []}
    try:
        for rep in range(ARGS.repeat):
            for name in (["tandem", "sglang"] if rep % 2 == 0 else ["sglang", "tandem"]):
                results[name].append(bench_router(name, f"http://127.0.0.1:{pport}", boot, f"http://127.0.0.1:{dport}"))
                print(f"rep {rep + 1} {name}: " + ", ".join(f"{p}{' stream' if s else ''} {v[0]:.0f}" for (p, s), v in results[name][-1].items()), flush=True)
    finally:
        stop(prefill)
        stop(decode)
    report(results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured time under the same load first")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--events", type=int, default=16, help="token events of a streamed answer")
    parser.add_argument("--tandem-args", default="", help="extra `tandem router` flags")
    parser.add_argument("--sglang-args", default="", help="extra sglang-router flags")
    ARGS = parser.parse_args()
    main()

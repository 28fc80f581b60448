"""Router throughput: Tandem's router vs sglang-router (Rust, PD mode) in front of the same mock prefill and
decode workers (benchmarks/router_mock.py), 32 clients on keep-alive connections, JSON and streaming.

    .venv/bin/python benchmarks/router_bench.py [--clients 32] [--seconds 4] [--repeat 5] [--events 16]
        [--tandem-args "--processes 2"] [--sglang-args "..."]

Tandem's router runs one process per CPU by default (`--processes`), as sglang-router runs a thread per CPU.

Both routers run side by side (idle while the other is measured); each repetition measures every mode on
one router right after the other, in alternating order, so both see the same load from whatever else runs
on the machine. Every answer is checked byte for byte against the decode's body (neither router changes it
when no logprobs are asked for): a wrong answer counts as an error, not as throughput. The table gives
medians over the repetitions: req/s, the ratio Tandem / sglang-router, the routers' CPU time per request
(all their processes and threads) and the median latency.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.router_mock import bodies  # noqa: E402
from tests.conftest import free_port  # noqa: E402

PROMPT = "Summarise the following text in one sentence. " * 10
MODES = [("/generate", False), ("/generate", True), ("/v1/chat/completions", False), ("/v1/chat/completions", True)]
ROUTERS = ("tandem", "sglang")
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def http_request(port: int, path: str, stream: bool) -> bytes:
    if path == "/generate":
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "stream": stream}
    else:
        body = {"model": "mock", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": stream}
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


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
class Result:
    rps: float
    p50_ms: float
    cpu_us: float  # router CPU per request
    workers_cpu_us: float  # both mock workers' CPU per request
    errors: int
    first_error: str


async def load(port: int, path: str, stream: bool, clients: int, seconds: float, warmup: float, expected: bytes):
    """(latencies of the answers that finished in the measured window, answers in all, errors, first error)."""
    request, done, errors = http_request(port, path, stream), [], [0, ""]
    start = time.monotonic()
    until = start + warmup + seconds

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < until:
            sent = time.monotonic()
            writer.write(request)
            status, body, keep_alive = await read_response(reader)
            now = time.monotonic()
            if status == 200 and body == expected:
                done.append((now, now - sent))
            else:
                errors[0] += 1
                errors[1] = errors[1] or f"HTTP {status}: {body[:300]!r}"
            if not keep_alive:
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return [lat for t, lat in done if t >= start + warmup], len(done) + errors[0], errors[0], errors[1]


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, its threads and its descendants (alive ones)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += sum(int(x) for x in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def measure(
    proc: subprocess.Popen, port: int, mocks: list[subprocess.Popen], path: str, stream: bool, a: argparse.Namespace
) -> Result:
    expected = b"".join(bodies(a.events)[path, stream])
    before, mocks_before = cpu_ticks(proc.pid), sum(cpu_ticks(m.pid) for m in mocks)
    lats, answers, errors, first_error = asyncio.run(load(port, path, stream, a.clients, a.seconds, a.warmup, expected))
    # over the warm-up too, so per answer over all answers
    per_answer = lambda ticks: 1e6 * ticks * TICK_S / max(answers, 1)  # noqa: E731
    return Result(
        len(lats) / a.seconds,
        1000 * statistics.median(lats) if lats else float("nan"),
        per_answer(cpu_ticks(proc.pid) - before),
        per_answer(sum(cpu_ticks(m.pid) for m in mocks) - mocks_before),
        errors,
        first_error,
    )


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
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def router_cmd(name: str, port: int, prefill: str, boot: int, decode: str, a: argparse.Namespace) -> list[str]:
    if name == "tandem":
        return [
            sys.executable,
            "-m",
            "tandem",
            "router",
            "--prefill",
            prefill,
            str(boot),
            "--decode",
            decode,
            "--port",
            str(port),
            "--policy",
            "round_robin",
            *shlex.split(a.tandem_args),
        ]
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill",
        prefill,
        str(boot),
        "--decode",
        decode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_port()),
        *shlex.split(a.sglang_args),
    ]


def report(results: dict[tuple[str, str, bool], list[Result]], a: argparse.Namespace, load_before: float) -> None:
    print(
        f"\n{a.clients} clients, {a.seconds:g} s per run after {a.warmup:g} s warm-up, {a.repeat} repetitions, "
        f"{a.events} SSE events per streamed answer; {os.cpu_count()} CPUs, load average {load_before:.1f} before "
        f"and {os.getloadavg()[0]:.1f} after; tandem router {a.tandem_args or '(defaults)'}, "
        f"{'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio loop (uvloop not installed)'}"
    )
    print(
        "CPU: microseconds of CPU time per request of the router (all its processes and threads) and of the two "
        "mock workers together; t|s = tandem|sglang"
    )
    print(
        f"{'mode':<28} {'tandem req/s':>12} {'sglang req/s':>12} {'ratio':>6} {'router CPU t|s':>15} "
        f"{'workers CPU t|s':>16} {'p50 ms t|s':>12}"
    )
    for path, stream in MODES:
        med = {
            n: [
                statistics.median(getattr(r, f) for r in results[n, path, stream])
                for f in ("rps", "cpu_us", "workers_cpu_us", "p50_ms")
            ]
            for n in ROUTERS
        }
        t, s = med["tandem"], med["sglang"]
        print(
            f"{path + (' stream' if stream else ' json'):<28} {t[0]:>12.0f} {s[0]:>12.0f} {t[0] / s[0]:>6.2f} "
            f"{t[1]:>7.0f}|{s[1]:<7.0f} {t[2]:>8.0f}|{s[2]:<7.0f} {t[3]:>5.1f}|{s[3]:<5.1f}"
        )
    for (n, path, stream), rs in results.items():
        print(
            f"  {n} {path}{' stream' if stream else ''} req/s per repetition: " + " ".join(f"{r.rps:.0f}" for r in rs)
        )
        for r in rs:
            if r.errors:
                print(f"    {r.errors} wrong answers, the first: {r.first_error}")


def main(a: argparse.Namespace) -> None:
    load_before = os.getloadavg()[0]
    boot, pport, dport = free_port(), free_port(), free_port()
    prefill, decode = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{dport}"
    mock = [sys.executable, str(ROOT / "benchmarks" / "router_mock.py"), "--events", str(a.events)]
    procs = [
        spawn([*mock, "--role", "prefill", "--port", str(pport)], prefill + "/health", "mock prefill"),
        spawn([*mock, "--role", "decode", "--port", str(dport)], decode + "/health", "mock decode"),
    ]
    results: dict[tuple[str, str, bool], list[Result]] = {(n, p, s): [] for n in ROUTERS for p, s in MODES}
    try:
        routers = {}
        for name in ROUTERS:
            port = free_port()
            procs.append(
                spawn(router_cmd(name, port, prefill, boot, decode, a), f"http://127.0.0.1:{port}/readiness", name)
            )
            routers[name] = (procs[-1], port)
        for rep in range(a.repeat):
            for k, (path, stream) in enumerate(MODES):
                for name in ROUTERS if (rep + k) % 2 == 0 else ROUTERS[::-1]:
                    results[name, path, stream].append(r := measure(*routers[name], procs[:2], path, stream, a))
                    print(
                        f"rep {rep + 1} {name:<6} {path}{' stream' if stream else ''}: {r.rps:.0f} req/s, "
                        f"{r.cpu_us:.0f} us CPU/req",
                        flush=True,
                    )
    finally:
        for p in procs:
            stop(p)
    report(results, a, load_before)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured time per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured time under the same load first")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--events", type=int, default=16, help="token events of a streamed answer")
    parser.add_argument("--tandem-args", default=f"--processes {os.cpu_count()}", help="extra `tandem router` flags")
    parser.add_argument("--sglang-args", default="", help="extra sglang-router flags")
    main(parser.parse_args())

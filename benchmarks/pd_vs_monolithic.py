"""TTFT of PD (router -> prefill -> decode) vs the monolithic server at concurrency 1 for 64-, 512- and
2048-token prompts, and ITL p99 of requests already decoding while long prompts keep arriving.
Both deployments run side by side in one run on this machine; prints ratios PD / monolithic.

    .venv/bin/python benchmarks/pd_vs_monolithic.py [--backend mooncake] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import start_server  # noqa: E402
from tests.integration.cluster import start_cluster  # noqa: E402

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "512", "--max-total-tokens", "65536")


def chunk_arrivals(client: Any, url: str, body: dict) -> tuple[float, list[float]]:
    """Stream `body` to `url`/generate through `client` (httpx or an httpx.Client): the send time and the
    arrival time of every streamed chunk (time.monotonic(), the clock of the servers' timelines)."""
    send, arrivals = time.monotonic(), []
    with client.stream("POST", url + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(line)
                arrivals.append(time.monotonic())
    return send, arrivals


def stream_times(url: str, ids: list[int], max_tokens: int) -> list[float]:
    """Arrival time of every streamed chunk, relative to the request start."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    send, arrivals = chunk_arrivals(httpx, url, body)
    return [t - send for t in arrivals]


def ttft(url: str, rng: random.Random, length: int, repeat: int) -> float:
    vals = [stream_times(url, [rng.randrange(100, 40000) for _ in range(length)], 2)[0] for _ in range(repeat)]
    return statistics.median(vals)


def itl_p99_under_load(url: str, rng: random.Random, seconds: float) -> float:
    itls: list[float] = []
    stop = time.monotonic() + seconds

    def decoder() -> None:
        while time.monotonic() < stop:
            t = stream_times(url, [rng.randrange(100, 40000) for _ in range(32)], 64)
            itls.extend(b - a for a, b in zip(t[1:], t[2:]))

    def long_prompts() -> None:
        while time.monotonic() < stop:
            stream_times(url, [rng.randrange(100, 40000) for _ in range(2048)], 1)

    threads = [threading.Thread(target=decoder) for _ in range(4)] + [threading.Thread(target=long_prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    itls.sort()
    return itls[int(0.99 * (len(itls) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="mooncake")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--load-seconds", type=float, default=60)
    ns = ap.parse_args()
    mono = start_server(*FLAGS, name="bench-mono").wait_ready()
    pd = start_cluster(ns.backend, flags=FLAGS)
    try:
        rows = []
        for length in tqdm([64, 512, 2048], desc="TTFT"):
            for url in (mono.url, pd.url):  # warm-up
                stream_times(url, [5] * 16, 2)
            m = ttft(mono.url, random.Random(length), length, ns.repeat)
            p = ttft(pd.url, random.Random(length), length, ns.repeat)
            rows.append((f"TTFT p50, {length}-token prompt", m, p))
        m = itl_p99_under_load(mono.url, random.Random(1), ns.load_seconds)
        p = itl_p99_under_load(pd.url, random.Random(1), ns.load_seconds)
        rows.append(("ITL p99, decoding while 2048-token prompts arrive", m, p))
    finally:
        pd.stop()
        mono.stop()
    print(f"\n{'metric':52} {'monolithic ms':>14} {'PD ms':>10} {'PD/mono':>8}")
    for name, m, p in rows:
        print(f"{name:52} {1000 * m:14.1f} {1000 * p:10.1f} {p / m:8.2f}")


if __name__ == "__main__":
    main()

"""Tensor parallelism on this machine: per rank, the weights it keeps and its peak RSS, against the whole
model at TP 1; and the decode step (one request, greedy) at each TP size, for the record.

    .venv/bin/python benchmarks/tp_ranks.py --model builtin --tp 1 3 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, tp: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem", "serve", "--model", model, "--port", str(port), "--tp-size", str(tp)]
    cmd += ["--max-total-tokens", "4096"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(1)
    proc.kill()
    raise TimeoutError(f"TP {tp} not ready")


def decode_ms_per_token(url: str, tokens: int) -> float:
    body = {"text": "The history of Europe", "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    body["sampling_params"]["ignore_eos"] = True
    httpx.post(url + "/generate", json=body | {"sampling_params": {"max_new_tokens": 4}}, timeout=600)  # warm-up
    times = []
    with httpx.stream("POST", url + "/generate", json=body | {"stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                times.append(time.monotonic())
    gaps = [b - a for a, b in zip(times[1:], times[2:])]  # after the first token: decode steps only
    return 1000 * sorted(gaps)[len(gaps) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="builtin")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--tokens", type=int, default=64)
    ns = p.parse_args()
    mib = 2**20
    print("| TP | rank | weights MiB | KV pool MiB | peak RSS MiB | decode step ms (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tp in ns.tp:
        proc, url = start(ns.model, tp)
        try:
            step = decode_ms_per_token(url, ns.tokens)
            for r in httpx.get(url + "/get_server_info", timeout=30).json()["tp"]["ranks"]:
                row = [tp, r["rank"], f"{r['weight_bytes'] / mib:.1f}", f"{r['kv_pool_bytes'] / mib:.1f}"]
                row += [f"{r['peak_rss_bytes'] / mib:.0f}", f"{step:.1f}" if r["rank"] == 0 else ""]
                print("| " + " | ".join(map(str, row)) + " |", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()

"""CPU per request of the router's HTTP client alone (router/http1.py) against a mock decode worker
(benchmarks/router_mock.py): 16 concurrent callers on one pool, JSON answers and chunked SSE answers.

    .venv/bin/python benchmarks/router_client_bench.py [--requests 4000] [--repeat 5]

It reports this process's CPU time per request (process_time, the worker is another process), which a
busy machine inflates far less than it does req/s: run it at two commits to compare two clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.http1 import Pool  # noqa: E402
from tests.conftest import free_port  # noqa: E402

CALLERS = 16


async def cpu_per_request(port: int, stream: bool, n: int) -> float:
    """µs of this process's CPU per request, after a warm-up."""
    pool = Pool(f"http://127.0.0.1:{port}")
    body = json.dumps({"text": "x" * 400, "sampling_params": {"max_new_tokens": 16}, "stream": stream}).encode()

    async def caller(k: int) -> None:
        for _ in range(k):
            resp = await pool.post("/generate", body, 30).send()
            while await resp.chunk():
                pass
            resp.close()

    await asyncio.gather(*(caller(50) for _ in range(CALLERS)))
    start = time.process_time()
    await asyncio.gather(*(caller(n // CALLERS) for _ in range(CALLERS)))
    pool.close()
    return 1e6 * (time.process_time() - start) / (n // CALLERS * CALLERS)


def main(a: argparse.Namespace) -> None:
    import uvloop

    port = free_port()
    mock = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "router_mock.py"), "--role", "decode", "--port", str(port)]
    )
    try:
        time.sleep(1.5)
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeat):
            for stream in (False, True):
                runs[stream].append(uvloop.run(cpu_per_request(port, stream, a.requests // (1 + 3 * stream))))
        for stream, values in runs.items():
            name = "SSE stream (16 events)" if stream else "JSON"
            print(
                f"{name:<24} median {statistics.median(values):6.1f} µs CPU/request  ({' '.join(f'{v:.1f}' for v in values)})"
            )
    finally:
        mock.terminate()
        mock.wait(10)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=5)
    main(p.parse_args())

"""`tandem bench`: send N streaming requests to any OpenAI-compatible endpoint at a rate/concurrency;
print TTFT, ITL, end-to-end latency percentiles and output tokens/s."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

WORDS = "the of and to in is was for on that with as by at from his her an were are which this be or has".split()


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (Poisson); 0 = as fast as concurrency allows")
    p.add_argument("--input-len", type=int, default=256, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")


def make_prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one_request(session: aiohttp.ClientSession, url: str, prompt: str, output_len: int) -> Sample:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    sample = Sample(ok=False)
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return Sample(ok=False, error=f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(ok=False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    sample.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if sample.ttft == 0.0:
                        sample.ttft = now - start
                    else:
                        sample.itls.append(now - last)
                    last = now
    except aiohttp.ClientError as e:
        return Sample(ok=False, error=repr(e))
    sample.e2e = time.perf_counter() - start
    sample.ok = True
    return sample


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q / 100 * len(values)), len(values) - 1)]


async def run(ns: argparse.Namespace) -> dict:
    rng = random.Random(ns.seed)
    prompts = [make_prompt(rng, ns.input_len) for _ in range(ns.num_requests)]
    sem = asyncio.Semaphore(ns.concurrency)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    bar = tqdm(total=ns.num_requests, desc="requests", unit="req")
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def task(p: str) -> Sample:
            async with sem:
                s = await one_request(session, ns.url, p, ns.output_len)
                bar.update(1)
                return s

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(task(p)))
            if ns.rate > 0:
                await asyncio.sleep(rng.expovariate(ns.rate))
        samples = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return summarize(samples, duration, ns)


def summarize(samples: list[Sample], duration: float, ns: argparse.Namespace) -> dict:
    ok = [s for s in samples if s.ok]
    itls = [x for s in ok for x in s.itls]
    out = {
        "url": ns.url, "requests": len(samples), "failed": len(samples) - len(ok), "concurrency": ns.concurrency,
        "duration_s": round(duration, 3), "output_tokens": sum(s.output_tokens for s in ok),
        "output_tok_per_s": round(sum(s.output_tokens for s in ok) / duration, 2) if duration else 0.0,
    }
    for name, vals in (("ttft", [s.ttft for s in ok]), ("itl", itls), ("e2e", [s.e2e for s in ok])):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = round(1000 * pct(vals, q), 2)
    out["ttft_mean_ms"] = round(1000 * statistics.fmean([s.ttft for s in ok]), 2) if ok else float("nan")
    errors = [s.error for s in samples if not s.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


def print_table(res: dict) -> None:
    print(f"\n{res['requests']} requests ({res['failed']} failed) in {res['duration_s']} s, concurrency {res['concurrency']}")
    print(f"output tokens/s: {res['output_tok_per_s']}")
    print(f"{'metric':<8}{'p50 ms':>12}{'p90 ms':>12}{'p99 ms':>12}")
    for name in ("ttft", "itl", "e2e"):
        print(f"{name:<8}" + "".join(f"{res[f'{name}_p{q}_ms']:>12}" for q in (50, 90, 99)))
    if "first_error" in res:
        print(f"first error: {res['first_error']}")


def run_bench(ns: argparse.Namespace) -> dict:
    res = asyncio.run(run(ns))
    print(json.dumps(res)) if ns.json else print_table(res)
    return res

"""One run: warm-up, then the workload's requests sent at their arrival times (open loop), at most
--max-concurrency in flight, with a live progress bar; and a sweep of runs over rates and endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from tandem.bench.client import RequestOutput, timed_request
from tandem.bench.endpoint import Endpoint
from tandem.bench.multiturn import Conversation, per_turn, run_conversations
from tandem.bench.stats import summarize
from tandem.bench.workload import BenchRequest, Workload

READ_BUFFER_BYTES = 10 * 1024 * 1024  # a /generate stream repeats the whole output in every event


@dataclass
class Plan:
    """What one request rate sends, to every endpoint alike: requests, or conversations (multi-turn; one
    arrival each)."""

    request_rate: float
    requests: list[BenchRequest]
    arrivals: list[float]
    warmup: list[BenchRequest]
    conversations: list[Conversation] | None = None
    think_time_s: float = 0.0

    @property
    def total(self) -> int:
        """Requests the plan sends."""
        return sum(c.turns for c in self.conversations) if self.conversations else len(self.requests)


@dataclass
class RunResult:
    """One endpoint at one request rate: every request's output and their summary (stats.summarize)."""

    endpoint: Endpoint
    request_rate: float
    max_concurrency: int | None
    outputs: list[RequestOutput]
    summary: dict


def make_session(api_key: str | None, request_timeout_s: float) -> aiohttp.ClientSession:
    """No connection cap (aiohttp's default of 100 would cap the load silently)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=request_timeout_s),
        connector=aiohttp.TCPConnector(limit=0),
        read_bufsize=READ_BUFFER_BYTES,
    )


async def warm_up_endpoint(session: aiohttp.ClientSession, endpoint: Endpoint, requests: list[BenchRequest]) -> None:
    """Unmeasured requests (prompts not in the workload, so no cache hit is planted); all failing ends the bench."""
    outputs = await asyncio.gather(*(timed_request(session, endpoint, r) for r in requests))
    if outputs and not any(o.success for o in outputs):
        raise SystemExit(f"{endpoint.url}: every warm-up request failed: {outputs[0].error}")


async def run_once(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_concurrency: int | None,
    bar: tqdm,
) -> tuple[list[RequestOutput], float]:
    """Send request i at arrivals[i] seconds after the start; return the outputs and the run's duration."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(req: BenchRequest, at: float) -> RequestOutput:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            out = await timed_request(session, endpoint, req)
        bar.update(1)
        return out

    outputs = await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals)))
    return list(outputs), time.perf_counter() - start


async def run_plan(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    plan: Plan,
    workload: Workload,
    max_concurrency: int | None,
    bar: tqdm,
) -> tuple[list[RequestOutput], float]:
    """The plan's requests, or its conversations, against one endpoint."""
    if plan.conversations is None:
        return await run_once(session, endpoint, plan.requests, plan.arrivals, max_concurrency, bar)
    return await run_conversations(
        session, endpoint, workload, plan.conversations, plan.arrivals, plan.think_time_s, max_concurrency, bar
    )


async def sweep(
    session: aiohttp.ClientSession,
    endpoints: list[Endpoint],
    plans: list[Plan],
    workload: Workload,
    max_concurrency: int | None,
    slos_ms: dict[str, float],
    show_progress: bool,
) -> list[RunResult]:
    """For each plan (request rate), each endpoint in turn: the same requests at the same arrival times."""
    results = []
    for plan in plans:
        for endpoint in endpoints:
            await warm_up_endpoint(session, endpoint, plan.warmup)
            label = f"{endpoint.base_url} @ {'inf' if math.isinf(plan.request_rate) else plan.request_rate} req/s"
            with tqdm(total=plan.total, desc=label, unit="req", disable=not show_progress) as bar:
                outputs, duration = await run_plan(session, endpoint, plan, workload, max_concurrency, bar)
            summary = summarize(outputs, duration, slos_ms)
            if plan.conversations is not None:
                summary["turns"] = per_turn(outputs)
            results.append(RunResult(endpoint, plan.request_rate, max_concurrency, outputs, summary))
    return results

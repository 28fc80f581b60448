"""What the planner sees each interval: the router's workers (`GET /workers`: role, health, requests in flight) and
each healthy worker's own /metrics, summed per role into one Observation.

    prefill   servers; prompt tokens queued (tandem_prefill_queue_tokens) and the prefill rate that drains them
              (router/placement/worker_stats.py: measured forwards, else the start-up calibration); the mean prompt of the
              requests they finished lately (tandem_prompt_tokens / tandem_requests_finished: their growth over
              the last interval in which any finished)
    decode    servers; KV pages in use over the total (tandem_kv_pages_*); requests waiting for pages
              (tandem_pd_queue_requests{queue="prealloc"})
    latency   the p90 over the interval of the decodes' time to first token and inter-token latency
              (tandem_time_to_first_token_seconds, tandem_inter_token_latency_seconds: their buckets' growth)
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.placement.worker_stats import Stats, parse_metrics

TTFT = "tandem_time_to_first_token_seconds"
ITL = "tandem_inter_token_latency_seconds"


@dataclass(frozen=True)
class WorkerView:
    url: str
    role: str
    in_flight: int


@dataclass
class Observation:
    prefill: int = 0
    decode: int = 0
    queue_tokens: float = 0.0  # prompt tokens waiting for the prefills
    prefill_tokens_per_s: float = 0.0  # the prefills' measured rate, summed
    prompt_tokens: float = 0.0  # mean tokens of the prompts the prefills finished lately (0: none yet)
    kv_use: float = 0.0  # decodes' KV pages in use / total
    waiting_for_pages: float = 0.0  # decode requests waiting for pages (prealloc), summed
    ttft_p90_s: float | None = None  # None: no first token in the interval
    itl_p90_s: float | None = None
    workers: list[WorkerView] = field(default_factory=list)

    @property
    def queue_s(self) -> float:
        """Seconds the prefills need to compute what waits for them."""
        return self.queue_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0

    @property
    def ttft_predicted_s(self) -> float | None:
        """Seconds a prompt arriving now spends at the prefills: the tokens queued ahead of it, spread over the
        prefills, then its own (a mean prompt) at one prefill's rate; None while no rate is known."""
        if not self.prefill_tokens_per_s or not self.prefill:
            return None
        return (self.queue_tokens + self.prefill * self.prompt_tokens) / self.prefill_tokens_per_s


@dataclass
class WorkerRead:
    """One worker's /metrics as the planner reads them."""

    pages: dict[str, float] = field(default_factory=dict)  # free, cached, used, total
    prealloc: float = 0.0
    prompt_tokens: float = 0.0  # counters: prompt tokens of the finished requests, and those requests
    finished: float = 0.0
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative count


def read_sample(text: str) -> WorkerRead:
    s = WorkerRead()
    for family in text_string_to_metric_families(text):
        for x in family.samples:
            if x.name.startswith("tandem_kv_pages_"):
                s.pages[x.name.removeprefix("tandem_kv_pages_")] = x.value
            elif x.name == "tandem_pd_queue_requests" and x.labels.get("queue") == "prealloc":
                s.prealloc = x.value
            elif x.name == "tandem_prompt_tokens_total":
                s.prompt_tokens = x.value
            elif x.name == "tandem_requests_finished_total":
                s.finished += x.value  # summed over the reasons
            elif x.name in (TTFT + "_bucket", ITL + "_bucket"):
                le = float(x.labels["le"])
                s.buckets.setdefault(x.name.removesuffix("_bucket"), {})[le] = x.value
    return s


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of what a cumulative histogram gained between two reads (PromQL's histogram_quantile: linear
    within the bucket); None when it gained nothing."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, prev_bound, prev_count = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_bound, prev_count = bound, count
    return prev_bound


class Observer:
    """Reads the router's workers and their metrics; keeps the last read of each worker for the intervals' deltas."""

    def __init__(self, router: str, headers: dict[str, str] | None = None, timeout_s: float = 5.0):
        self.router, self.headers, self.timeout = router.rstrip("/"), headers, aiohttp.ClientTimeout(total=timeout_s)
        self.last: dict[str, WorkerRead] = {}
        self.rates: dict[str, Stats] = {}
        self.prompt_tokens = 0.0  # the prefills' mean prompt, kept across intervals in which none finished

    async def observe(self, session: aiohttp.ClientSession, now: float) -> Observation:
        async with session.get(self.router + "/workers", headers=self.headers, timeout=self.timeout) as r:
            r.raise_for_status()
            listed = (await r.json())["workers"]
        workers = [WorkerView(w["url"], w["role"], w["in_flight"]) for w in listed if w["healthy"]]
        texts = await asyncio.gather(*(self._metrics(session, w.url) for w in workers))
        return self.summarize(workers, dict(zip((w.url for w in workers), texts)), now)

    async def _metrics(self, session: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with session.get(url + "/metrics", headers=self.headers, timeout=self.timeout) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    def summarize(self, workers: list[WorkerView], texts: dict[str, str | None], now: float) -> Observation:
        """One Observation from the workers and their /metrics texts (None: not read this time)."""
        obs = Observation(workers=workers)
        used = total = 0.0
        ttft: tuple[dict[float, float], dict[float, float]] = ({}, {})
        itl: tuple[dict[float, float], dict[float, float]] = ({}, {})
        grown: dict[str, float] = {}  # what the prefills finished in the interval: requests, their prompt tokens
        for w in workers:
            obs.prefill += w.role == "prefill"
            obs.decode += w.role == "decode"
            text = texts.get(w.url)
            if text is None:
                continue
            sample = read_sample(text)
            before = self.last.get(w.url, sample)  # a worker first read adds nothing to the interval's latencies
            rates = self.rates.setdefault(w.url, Stats())
            rates.update(parse_metrics(text), now)
            self.last[w.url] = sample
            if w.role == "prefill":
                obs.queue_tokens += rates.queue_tokens
                obs.prefill_tokens_per_s += rates.prefill_tokens_per_s
                if sample.finished > before.finished and sample.prompt_tokens >= before.prompt_tokens:  # not restarted
                    _add(grown, {"finished": sample.finished - before.finished,
                                 "prompt_tokens": sample.prompt_tokens - before.prompt_tokens})  # fmt: skip
                continue
            used += sample.pages.get("used", 0.0)
            total += sample.pages.get("total", 0.0)
            obs.waiting_for_pages += sample.prealloc
            for name, (b, a) in ((TTFT, ttft), (ITL, itl)):
                _add(b, before.buckets.get(name, {}))
                _add(a, sample.buckets.get(name, {}))
        if grown:
            self.prompt_tokens = grown["prompt_tokens"] / grown["finished"]
        obs.prompt_tokens = self.prompt_tokens
        obs.kv_use = used / total if total else 0.0
        obs.ttft_p90_s, obs.itl_p90_s = quantile(0.9, *ttft), quantile(0.9, *itl)
        return obs


def _add(into: dict, counts: dict) -> None:
    """Add `counts` into `into`, key by key (a histogram's buckets by bound, or named counts)."""
    for key, count in counts.items():
        into[key] = into.get(key, 0.0) + count

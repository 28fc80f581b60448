"""What each worker's forwards and wire cost, measured from the worker's own /metrics (docs/placement.md).

Every `--placement-poll-interval-s` the router scrapes each healthy worker's /metrics and keeps, per worker:

    prefill rate    prompt tokens per second of its extend forwards: the rate of tandem_forward_{tokens,seconds}
                    {mode="extend"} between two scrapes (an EWMA), or, before any moved, the start-up calibration
                    (tandem_calibration_prefill_tokens_per_second)
    decode step     seconds of one decode step: tandem_forward_{seconds,steps}{mode="decode"}, or the calibration
    wire rate       a prefill's KV bytes per second of writing: tandem_kv_transfer_events{event="bytes_sent"} over
                    tandem_kv_transfer_write_seconds (unknown, None, until it has written)
    now             prompt tokens waiting for prefill, requests running, KV pages free (free + reclaimable cache),
                    bytes of one page, its prefill chunk

A worker not scraped yet has no stats: the placement cost then prices it by the router's own counts alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.workers import Worker, WorkerRegistry

log = logging.getLogger("tandem.router")
EWMA = 0.3  # weight of the newest interval's rate
MIN_BUSY_S = 0.02  # forward seconds an interval needs before its rate counts (a few steps, not noise)


@dataclass
class Sample:
    """The values one scrape read (counters as totals)."""

    extend_tokens: float = 0.0
    extend_s: float = 0.0
    decode_steps: float = 0.0
    decode_s: float = 0.0
    bytes_sent: float = 0.0
    write_s: float = 0.0
    calibration_rate: float = 0.0
    calibration_step_s: float = 0.0
    queue_tokens: float = 0.0
    running: float = 0.0
    free_pages: float = 0.0
    page_bytes: float = 0.0
    chunk_tokens: float = 0.0


@dataclass
class Stats:
    """One worker's measured costs (see the module docstring)."""

    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    wire_bytes_per_s: float | None = None
    queue_tokens: int = 0
    running: int = 0
    free_pages: int = 0
    page_bytes: int = 0
    chunk_tokens: int = 0
    at: float = 0.0
    last: Sample = field(default_factory=Sample)

    def update(self, s: Sample, now: float) -> None:
        prev, first = self.last, self.at == 0.0
        self.prefill_tokens_per_s = _busy_rate(
            self.prefill_tokens_per_s if not first else 0.0,
            s.extend_tokens - prev.extend_tokens,
            s.extend_s - prev.extend_s,
            s.calibration_rate,
            first,
        )
        step = _busy_rate(
            1 / self.decode_step_s if self.decode_step_s and not first else 0.0,
            s.decode_steps - prev.decode_steps,
            s.decode_s - prev.decode_s,
            1 / s.calibration_step_s if s.calibration_step_s else 0.0,
            first,
        )
        self.decode_step_s = 1 / step if step else 0.0
        if s.write_s - prev.write_s >= MIN_BUSY_S and not first:
            rate = (s.bytes_sent - prev.bytes_sent) / (s.write_s - prev.write_s)
            self.wire_bytes_per_s = rate if self.wire_bytes_per_s is None else _ewma(self.wire_bytes_per_s, rate)
        elif first and s.write_s >= MIN_BUSY_S:
            self.wire_bytes_per_s = s.bytes_sent / s.write_s
        self.queue_tokens, self.running = int(s.queue_tokens), int(s.running)
        self.free_pages, self.page_bytes, self.chunk_tokens = int(s.free_pages), int(s.page_bytes), int(s.chunk_tokens)
        self.last, self.at = s, now


def _ewma(old: float, new: float) -> float:
    return (1 - EWMA) * old + EWMA * new


def _busy_rate(old: float, amount: float, busy_s: float, calibration: float, first: bool) -> float:
    """Units per busy second: the interval's when it was busy enough, blended into the old; the calibration
    until the worker has run anything (on the first scrape, the totals since start count as one interval)."""
    if busy_s >= MIN_BUSY_S:
        rate = amount / busy_s
        return rate if first or not old else _ewma(old, rate)
    return old or calibration


def parse_metrics(text: str) -> Sample:
    """The values of one /metrics text."""
    s = Sample()
    for family in text_string_to_metric_families(text):
        for x in family.samples:
            _read(s, x.name, x.labels, x.value)
    return s


def _read(s: Sample, name: str, labels: dict[str, str], value: float) -> None:
    mode = labels.get("mode")
    if name == "tandem_forward_tokens_total" and mode == "extend":
        s.extend_tokens = value
    elif name == "tandem_forward_seconds_total":
        if mode == "extend":
            s.extend_s = value
        elif mode == "decode":
            s.decode_s = value
    elif name == "tandem_forward_steps_total" and mode == "decode":
        s.decode_steps = value
    elif name == "tandem_kv_transfer_events_total" and labels.get("event") == "bytes_sent":
        s.bytes_sent = value
    else:
        field_name = GAUGES.get(name)
        if field_name is not None:
            setattr(s, field_name, getattr(s, field_name) + value)


GAUGES = {
    "tandem_kv_transfer_write_seconds_total": "write_s",
    "tandem_calibration_prefill_tokens_per_second": "calibration_rate",
    "tandem_calibration_decode_step_seconds": "calibration_step_s",
    "tandem_prefill_queue_tokens": "queue_tokens",
    "tandem_num_running_reqs": "running",
    "tandem_kv_pages_free": "free_pages",
    "tandem_kv_pages_cached": "free_pages",  # reclaimable: free and cached pages both admit a request
    "tandem_kv_page_bytes": "page_bytes",
    "tandem_prefill_chunk_tokens": "chunk_tokens",
}


class WorkerStats:
    """Every worker's Stats, kept fresh by `follow` (a task on the router's loop)."""

    def __init__(self, workers: WorkerRegistry, interval_s: float, timeout_s: float = 2.0):
        self.workers, self.interval_s, self.timeout_s = workers, interval_s, timeout_s
        self.stats: dict[str, Stats] = {}

    def get(self, worker: Worker) -> Stats | None:
        return self.stats.get(worker.url)

    async def follow(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.scrape_all(session)
            except Exception:  # a bug here must not stop the scraping for good
                log.exception("scraping the workers' metrics failed")
            await asyncio.sleep(self.interval_s)

    async def scrape_all(self, session: aiohttp.ClientSession) -> None:
        workers = [w for w in self.workers.workers.values() if w.healthy]
        await asyncio.gather(*(self.scrape(session, w) for w in workers))
        for url in set(self.stats) - set(self.workers.workers):
            del self.stats[url]

    async def scrape(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        try:
            async with worker.get(session, "/metrics", self.timeout_s) as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return  # the health checks say what is wrong with it; its last stats stay
        self.stats.setdefault(worker.url, Stats()).update(parse_metrics(text), time.monotonic())

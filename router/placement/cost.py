"""The one cost of a placement, in seconds (docs/placement.md): pure functions of what the router measured.

For a prompt of n tokens, a prefill p and a decode d (measured rates: router/placement/worker_stats.py):

    remote (p, d)   ttft  = overhead[remote] + queue(p) / rate(p) + (n - hit(p)) / rate(p)
                    wire  = bytes that cross / wire rate(p)          (the first token goes ahead of the KV, so the
                                                                      wire delays the second token, not the first)
                    cross = pages past hit(d) (remote_suffix) or every page (remote_full)
    local (d)       ttft  = overhead[local] + queue(d) / rate(d) + (n - hit(d)) / rate(d)
                            + (chunks - 1) * step(d) while d decodes (one decode step between two chunks)
                    interference = running(d) * (n - hit(d)) / rate(d)   (each running request waits that long)

    cost = ttft + wire + interference            misses = SLOs the option would miss, + 1 if d cannot admit it now

The least (misses, cost) wins. `overhead[path]` is what the model does not see (HTTP, pairing, the control
plane, the machine's load): the mean of observed TTFT minus predicted TTFT of the path's streamed requests
(`Overheads`), learned online.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_OVERHEAD_S = 10.0
OVERHEAD_EWMA = 0.2


@dataclass(frozen=True)
class Side:
    """One worker as the cost sees it: its measured rates and its load now."""

    tokens_per_s: float  # prefill rate (0: unmeasured; the side is then priced by its load alone)
    step_s: float = 0.0  # one decode step
    queue_tokens: int = 0  # prompt tokens waiting for its prefill (the worker's count or the router's, the larger)
    running: int = 0  # requests decoding (or about to)
    free_pages: int | None = None  # free + reclaimable KV pages (None: unknown)
    wire_bytes_per_s: float | None = None  # a prefill's measured write rate
    page_bytes: int = 0

    def seconds(self, tokens: int) -> float:
        return tokens / self.tokens_per_s if self.tokens_per_s > 0 else 0.0


@dataclass(frozen=True)
class Prompt:
    n: int  # tokens
    page: int  # page size (0: unknown, no pages hashed)
    chunk: int  # the decode's prefill chunk (tokens)


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None  # the request's own
    tpot_s: float | None = None
    running_tpot_s: float | None = None  # the tightest of the requests running on the decode


@dataclass
class Option:
    path: str  # remote_suffix | remote_full (what crosses) | local
    ttft_s: float  # predicted, overhead included
    wire_s: float = 0.0
    interference_s: float = 0.0
    cross_bytes: int = 0
    misses: int = 0
    terms: dict[str, float] = field(default_factory=dict)  # for the log and the tests

    @property
    def cost(self) -> float:
        return self.ttft_s + self.wire_s + self.interference_s

    @property
    def modelled_s(self) -> float:
        """The TTFT predicted without the learned overhead (what `Overheads.observe` compares with)."""
        return self.ttft_s - self.terms.get("overhead", 0.0)

    @property
    def key(self) -> tuple[int, float]:
        return self.misses, self.cost


def remote(prompt: Prompt, hit_p: int, hit_d: int, p: Side, d: Side, overhead_s: float, slo: Slo) -> Option:
    """The prompt computed on p, its KV past what d holds sent to d: remote_suffix, or remote_full when d holds
    none of it (a decode that holds a prefix always takes only the rest: fewer bytes, fewer pages)."""
    queue, compute = p.seconds(p.queue_tokens), p.seconds(prompt.n - hit_p)
    pages = _pages(prompt.n, prompt.page) - (hit_d // prompt.page if prompt.page else 0)
    cross_bytes = pages * (d.page_bytes or p.page_bytes)
    wire = cross_bytes / p.wire_bytes_per_s if p.wire_bytes_per_s else 0.0
    option = Option("remote_suffix" if hit_d else "remote_full", overhead_s + queue + compute, wire, 0.0, cross_bytes)
    option.terms = {"overhead": overhead_s, "queue": queue, "compute": compute, "wire": wire}
    option.misses = _misses(option, d, slo, decode_pages=pages)
    return option


def local(prompt: Prompt, hit_d: int, d: Side, overhead_s: float, slo: Slo) -> Option:
    """The prompt computed on d itself, its chunks taking turns with d's decode steps."""
    tokens = prompt.n - hit_d
    queue, compute = d.seconds(d.queue_tokens), d.seconds(tokens)
    turns = (max(1, -(-tokens // prompt.chunk)) - 1) * d.step_s if d.running and prompt.chunk else 0.0
    option = Option("local", overhead_s + queue + compute + turns, 0.0, d.running * compute)
    option.terms = {"overhead": overhead_s, "queue": queue, "compute": compute, "turns": turns}
    option.misses = _misses(option, d, slo, decode_pages=_pages(tokens, prompt.page))
    if (
        slo.running_tpot_s is not None
        and d.seconds(min(tokens, prompt.chunk or tokens)) + d.step_s > slo.running_tpot_s
    ):
        option.misses += 1  # one chunk between two of their tokens breaks their TPOT target
    return option


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page) if page else 0


def _misses(option: Option, d: Side, slo: Slo, decode_pages: int) -> int:
    misses = 0
    if slo.ttft_s is not None and option.ttft_s > slo.ttft_s:
        misses += 1
    if slo.tpot_s is not None and d.step_s > slo.tpot_s:
        misses += 1
    if d.free_pages is not None and decode_pages > d.free_pages:
        misses += 1  # the decode cannot admit it now: it would wait for pages
    return misses


class Overheads:
    """Per path, the mean of (observed - predicted) TTFT of streamed requests: what the model does not see."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.samples: dict[str, int] = {}

    def get(self, path: str) -> float:
        return self.seconds.get(path, 0.0)

    def observe(self, path: str, observed_s: float, modelled_s: float) -> None:
        """One streamed request of `path`: its TTFT as observed, and as the model predicted it without overhead."""
        residual = min(MAX_OVERHEAD_S, max(0.0, observed_s - modelled_s))
        n = self.samples.get(path, 0)
        weight = max(OVERHEAD_EWMA, 1 / (n + 1))  # the first samples average plainly, then the newest weigh more
        self.seconds[path] = (1 - weight) * self.get(path) + weight * residual
        self.samples[path] = n + 1

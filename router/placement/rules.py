"""`--pd-placement`: where a request's prompt is computed (docs/placement.md), by one of three rules.

    remote    always on a prefill (the pair --policy picks): the decode receives the KV past its cached prefix
    two_way   Dynamo's and llm-d's rule: on the decode --policy's pair names when the part of the prompt that
              decode lacks is shorter than --placement-local-threshold tokens, else remote
    cost      the least (SLO misses, cost) of every placement: each (prefill, decode) pair, and each decode alone
              (router/placement/cost.py prices them from router/placement/worker_stats.py's measurements)

A rule answers a Pair whose `path` says what crosses (remote_suffix: the KV past the decode's prefix; remote_full:
all of it, the decode holds none; local: nothing, no prefill) and `reason` why (policy, threshold, least_cost, slo,
no_prefill); None when no placement is possible.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from router.pair_call import Pair
from router.placement.cost import Option, Overheads, Prompt, Side, Slo, local, remote
from router.placement.kv_policy import KVAwarePolicy
from router.placement.worker_stats import WorkerStats
from router.request_hints import RequestHints
from router.workers import Worker

if TYPE_CHECKING:
    from router.placement.placer import PairPolicy


class Placement(Protocol):
    def place(
        self, prefills: list[Worker], decodes: list[Worker], body: dict[str, Any], hints: RequestHints
    ) -> Pair | None:
        """Where `body` runs among the candidates (`decodes` never empty; `prefills` may be)."""


def pick_decode(policy: PairPolicy, decodes: list[Worker], body: dict[str, Any]) -> Worker:
    """The decode `policy` would pair with, for a request no prefill computes."""
    side = getattr(policy, "decode", None)
    return side.pick(decodes, body) if side is not None else min(decodes, key=lambda w: w.in_flight)


class AlwaysRemote:
    def __init__(self, policy: PairPolicy, kv: KVAwarePolicy | None):
        self.policy, self.kv = policy, kv

    def place(self, prefills, decodes, body, hints) -> Pair | None:
        if not prefills:
            return None
        pair = self.policy.pick_pair(prefills, decodes, body)
        held = self.kv.held(pair.decode, body) if self.kv is not None else None
        pair.path = "remote_full" if held is False else "remote_suffix"  # unknown: the decode uses its cache
        return pair


class TwoWay:
    def __init__(self, policy: PairPolicy, kv: KVAwarePolicy, threshold: int):
        self.policy, self.kv, self.threshold = policy, kv, threshold

    def place(self, prefills, decodes, body, hints) -> Pair | None:
        if not prefills:
            return Pair(None, pick_decode(self.policy, decodes, body), "local", "no_prefill")
        pair = self.policy.pick_pair(prefills, decodes, body)
        n = self.kv.prompt_tokens(body)
        lacks = n - self.kv.held_tokens(pair.decode, body)
        if lacks < self.threshold:
            return Pair(None, pair.decode, "local", "threshold")
        pair.path, pair.reason = ("remote_suffix" if lacks < n else "remote_full"), "threshold"
        return pair


class PendingWork:
    """Prompt tokens the router sent to each worker that, by the cost's own prediction, are not computed yet: the
    router's view of a queue between two scrapes of the worker's (the larger of the two counts)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.work: dict[str, list[tuple[float, int]]] = {}  # url -> (predicted end, tokens)

    def add(self, url: str, tokens: int, seconds: float) -> None:
        self.work.setdefault(url, []).append((self.clock() + seconds, tokens))

    def tokens(self, url: str) -> int:
        now = self.clock()
        left = self.work[url] = [(end, n) for end, n in self.work.get(url, ()) if end > now]
        return sum(n for _, n in left)


class CostPlacement:
    def __init__(self, kv: KVAwarePolicy, stats: WorkerStats):
        self.kv, self.stats = kv, stats
        self.overheads = Overheads()
        self.pending = PendingWork()

    def side(self, worker: Worker) -> Side:
        s = self.stats.get(worker)
        queued = self.pending.tokens(worker.url)
        if s is None:
            return Side(0.0, queue_tokens=queued, running=worker.in_flight)
        return Side(
            s.prefill_tokens_per_s,
            s.decode_step_s,
            max(s.queue_tokens, queued),
            max(s.running, worker.in_flight),
            s.free_pages if s.at else None,
            s.wire_bytes_per_s,
            s.page_bytes,
        )

    def place(self, prefills, decodes, body, hints) -> Pair | None:
        n, page = self.kv.prompt_tokens(body), self.kv.page_size() or 0
        options: list[tuple[Option, Worker | None, Worker]] = []
        remote_s, local_s = self.overheads.get("remote"), self.overheads.get("local")
        sides = {w.url: self.side(w) for w in [*prefills, *decodes]}
        held = {w.url: self.kv.held_tokens(w, body) for w in [*prefills, *decodes]}
        for d in decodes:
            stats = self.stats.get(d)
            prompt = Prompt(n, page, (stats.chunk_tokens if stats else 0) or n)
            slo = Slo(hints.ttft_s, hints.tpot_s, _tightest_tpot(d))
            options.append((local(prompt, held[d.url], sides[d.url], local_s, slo), None, d))
            for p in prefills:
                option = remote(prompt, held[p.url], held[d.url], sides[p.url], sides[d.url], remote_s, slo)
                options.append((option, p, d))
        best = min(options, key=lambda o: (o[0].key, _load(o)))
        cheapest = min(options, key=lambda o: (o[0].cost, _load(o)))
        option, prefill, decode = best
        reason = "least_cost" if cheapest[0].misses <= option.misses else "slo"
        where = decode if prefill is None else prefill
        self.pending.add(where.url, n - held[where.url], option.modelled_s)
        return Pair(prefill, decode, option.path, reason, hints.tpot_s, option)

    def first_token(self, pair: Pair, seconds: float) -> None:
        """A streamed request's observed TTFT: the overhead of its path is learned from it."""
        if isinstance(pair.option, Option):
            self.overheads.observe("local" if pair.prefill is None else "remote", seconds, pair.option.modelled_s)


def _load(option: tuple[Option, Worker | None, Worker]) -> int:
    _, p, d = option
    return d.in_flight + (p.in_flight if p is not None else 0)


def _tightest_tpot(decode: Worker) -> float | None:
    """The tightest x-slo-tpot-ms of the requests in flight on `decode`."""
    slos = [c.pair.tpot_slo_s for c in decode.calls if getattr(c, "pair", None) and c.pair.tpot_slo_s]
    return min(slos, default=None)

"""The EPP's choice for one request: the router's own workers, health rounds, KV feeds and placement, asked once per
request by the gateway (router/epp/ext_proc.py).

    Picker.pick(body, subset)
      └─▶ Placer.pick      the router's placement (router/placement/placer.py): a (prefill, decode) pair by
                           --policy / --decode-policy / --pd-placement, or, for monolithic servers, one server by
                           the decode side's policy (a decode that computes its own prompt: path local)
      └─▶ Pick             the endpoint the gateway forwards to (HOST:PORT) and, for PD, the prefill it names

The EPP sees no answer (the gateway forwards it), but Envoy keeps a request's ext_proc stream open until the request
ends: a worker's requests in flight (`Worker.in_flight`, the load every policy reads, as in the router) are counted from
`Picker.pick` to `Picker.release` at the stream's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import aiohttp
from prometheus_client import Histogram

from common.wire.addresses import split_host_port
from router.discovery import Discovery, Target, targets_from_config
from router.epp.config import EppConfig
from router.metrics import RouterMetrics
from router.placement.kv_feeds import KVFeeds
from router.placement.kv_index import KVIndex
from router.placement.kv_policy import KVAwarePolicy
from router.placement.placer import Placer, pair_policy, placement_rule
from router.placement.worker_stats import WorkerStats
from router.request_hints import NONE, RequestHints
from router.workers import Worker, WorkerRegistry

MONOLITHIC = RequestHints(bypass_remote_prefill=True)  # one server computes the prompt and decodes


@dataclass(frozen=True)
class Pick:
    endpoint: str  # HOST:PORT the gateway sends the request to (a monolithic server, or a decode pod's sidecar)
    prefill: str | None = None  # HOST:PORT of the prefill the decode side reads the prompt's KV from (PD)
    workers: tuple[Worker, ...] = field(default=(), compare=False, repr=False)  # counted in flight until released


class NoEndpoint(Exception):
    """No candidate can serve the request: the gateway answers `status` (the protocol's 503)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


def host_port(worker: Worker) -> str:
    u = urlparse(worker.url)
    host = f"[{u.hostname}]" if u.hostname and ":" in u.hostname else u.hostname
    return f"{host}:{u.port or (443 if u.scheme == 'https' else 80)}"


class Picker:
    def __init__(self, config: EppConfig):
        self.pd = config.pd
        self.workers = WorkerRegistry(config.health_failure_threshold, config.health_check_timeout_s)
        for url in config.worker:
            self.workers.add(url, "decode")  # a server alone: the router's decode that computes the prompt
        for p in config.prefill:
            self.workers.add(p.url, "prefill", p.bootstrap_port, p.bootstrap_host)
        for url in config.decode:
            self.workers.add(url, "decode")
        targets = targets_from_config(config)  # type: ignore[arg-type]  (the discovery fields are the router's)
        if config.worker_discovery:
            targets.append(Target("decode", *split_host_port(config.worker_discovery)))
        self.discovery = Discovery(self.workers, targets)
        self.metrics = RouterMetrics(self.workers, lambda: 0)
        self.feeds = self.metrics.kv_feeds = KVFeeds(self.workers, KVIndex())
        kv = KVAwarePolicy(
            self.feeds.index,
            self.feeds,
            config.kv_load_tokens,
            self.metrics,
            config.kv_host_hit_weight,
            config.kv_store_hit_weight,
        )
        policy = pair_policy(config.policy, config.decode_policy, kv)
        stats = WorkerStats(self.workers, 1.0)  # never scraped: only --pd-placement cost reads it
        rule = placement_rule(config.pd_placement, policy, kv, stats, config.placement_local_threshold)
        self.placer = Placer(self.workers, policy, kv, rule, self.metrics)
        self.config = config
        self.pick_seconds = Histogram(
            "tandem_epp_pick_seconds",
            "time to pick an endpoint for one request (from its whole body)",
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1),
            registry=self.metrics.registry,
        )

    def ready(self) -> bool:
        """A request can be placed: a healthy server (monolithic) or a healthy decode with a prefill (PD)."""
        decodes = self.workers.healthy("decode")
        return bool(decodes) and (not self.pd or bool(self.workers.healthy("prefill")) or self._computes_locally)

    @property
    def _computes_locally(self) -> bool:
        return self.config.pd_placement != "remote"

    def pick(self, body: dict[str, Any], subset: Collection[str] | None = None) -> Pick:
        """Where `body` goes; only a decode (or server) whose HOST:PORT is in `subset` when the gateway gave one."""
        with self.pick_seconds.time():
            return self._pick(body, subset)

    def _pick(self, body: dict[str, Any], subset: Collection[str] | None) -> Pick:
        exclude = set()
        if subset is not None:
            allowed = set(subset)
            exclude = {
                w.url for w in self.workers.workers.values() if w.role == "decode" and host_port(w) not in allowed
            }
        pair = self.placer.pick(body, exclude, NONE if self.pd else MONOLITHIC)
        if pair is None:
            where = " of the gateway's subset" if subset is not None else ""
            kind = "decode with a healthy prefill" if self.pd else "server"
            raise NoEndpoint(f"no healthy {kind}{where} is available; retry later")
        workers = tuple(w for w in (pair.prefill, pair.decode) if w is not None)
        for w in workers:
            w.in_flight += 1
        return Pick(host_port(pair.decode), host_port(pair.prefill) if pair.prefill else None, workers)

    def release(self, pick: Pick) -> None:
        """The request `pick` placed has ended (its ext_proc stream closed)."""
        for w in pick.workers:
            w.in_flight -= 1

    def tasks(self, session: aiohttp.ClientSession) -> list[asyncio.Task]:
        """The background rounds (on the running loop): health, KV events, discovery."""
        tasks = [self.workers.health_loop(session, self.config.health_check_interval_s), self.feeds.follow(session)]
        if self.discovery.targets:
            tasks.append(self.discovery.run(session, self.config.discovery_interval_s))
        return [asyncio.create_task(t) for t in tasks]

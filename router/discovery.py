"""Finding workers by DNS: a name that resolves to one address per worker (a Kubernetes headless
Service lists every ready pod behind it). The router re-resolves the prefill and decode names every
interval, adds the workers that appeared and removes the ones that went away, so a role scales with
no router restart.

With --ssl-ca-certs the discovered workers speak HTTPS: the router dials each address and verifies the
worker's certificate against the discovery name (the Service's name, which a certificate can carry; a
pod's address cannot), so one certificate serves every replica.

Only workers this module added are ever removed by it: workers given with --prefill/--decode or
POST /workers stay. A name that does not exist (NXDOMAIN, no address: a Service with no ready pod)
means no workers; a failed lookup (DNS down, timeout) changes nothing until the next round.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from common.wire.addresses import split_host_port
from router.config import RouterConfig
from router.workers import WorkerRegistry

log = logging.getLogger("tandem.router")

# (host, port) -> the addresses it resolves to now; raises LookupError when the lookup itself failed
Resolver = Callable[[str, int], Awaitable[list[str]]]
NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve(host: str, port: int) -> list[str]:
    """The name's addresses, IPv4 ones when there are any (so `localhost` or a dual-stack Service counts
    each worker once), else IPv6 ones; [] when the name does not exist."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in NO_SUCH_NAME:
            return []
        raise LookupError(f"resolving {host}: {e}") from None
    addresses = {info[4][0] for info in infos}
    v4 = sorted(a for a in addresses if ipaddress.ip_address(a).version == 4)
    return v4 or sorted(addresses)


@dataclass(frozen=True)
class Target:
    """One discovery name and what its workers are."""

    role: str  # "prefill" | "decode"
    host: str
    port: int
    bootstrap_port: int | None = None
    bootstrap_host: str | None = None
    tls: bool = False  # https workers, their certificates naming `host`

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def tls_name(self) -> str | None:
        return self.host if self.tls else None


def targets_from_config(config: RouterConfig) -> list[Target]:
    targets = []
    tls = config.ssl_ca_certs is not None
    if config.prefill_discovery:
        host, port = split_host_port(config.prefill_discovery)
        targets.append(Target("prefill", host, port, config.prefill_bootstrap_port, config.prefill_bootstrap_host, tls))
    if config.decode_discovery:
        targets.append(Target("decode", *split_host_port(config.decode_discovery), tls=tls))
    return targets


class Discovery:
    """Keeps the registry's discovered workers equal to what the targets' names resolve to."""

    def __init__(self, workers: WorkerRegistry, targets: list[Target], resolver: Resolver = resolve):
        self.workers = workers
        self.targets = targets
        self.resolver = resolver
        self.found: dict[Target, set[str]] = {t: set() for t in targets}  # the worker URLs each target added

    async def refresh(self) -> tuple[set[str], set[str]]:
        """One round over every target: (URLs added, URLs removed)."""
        added: set[str] = set()
        removed: set[str] = set()
        for target in self.targets:
            try:
                urls = {target.url(a) for a in await self.resolver(target.host, target.port)}
            except LookupError as e:
                log.warning(
                    "%s discovery: %s; keeping its %d workers until the next round",
                    target.role,
                    e,
                    len(self.found[target]),
                )
                continue
            added |= self._add(target, urls - self.found[target])
            removed |= self._remove(target, self.found[target] - urls)
        return added, removed

    def _add(self, target: Target, urls: set[str]) -> set[str]:
        added = set()
        for url in sorted(urls):
            if url in self.workers.workers:  # given by hand: not this module's to remove later
                continue
            self.workers.add(url, target.role, target.bootstrap_port, target.bootstrap_host, target.tls_name)
            self.found[target].add(url)
            added.add(url)
            log.info("discovered %s worker %s (%s)", target.role, url, target.host)
        return added

    def _remove(self, target: Target, urls: set[str]) -> set[str]:
        for url in sorted(urls):
            # requests in flight keep their Worker object and finish; no new request picks it
            self.workers.remove(url)
            self.found[target].discard(url)
            log.info("%s worker %s is gone from %s; removed", target.role, url, target.host)
        return urls

    async def run(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Refresh every interval; new workers get a health check at once instead of at the next round."""
        while True:
            try:
                added, _ = await self.refresh()
                await asyncio.gather(
                    *(self.workers.check(session, self.workers.workers[u]) for u in added if u in self.workers.workers)
                )
            except Exception:  # a bug here must not stop discovery for good
                log.exception("discovery round failed")
            await asyncio.sleep(interval_s)

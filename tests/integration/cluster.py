"""A local PD cluster for tests: prefill servers (embedded bootstrap), decode servers and the router,
each a real process on 127.0.0.1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from tests.conftest import ServerProcess, free_port, start_server


@dataclass
class Cluster:
    prefills: list[ServerProcess] = field(default_factory=list)
    decodes: list[ServerProcess] = field(default_factory=list)
    router: ServerProcess | None = None
    bootstrap: ServerProcess | None = None  # a standalone registry shared by every prefill, if any
    policy: str = "round_robin"
    router_args: tuple[str, ...] = ()  # the router's other flags

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def nodes(self) -> list[ServerProcess]:
        return self.prefills + self.decodes

    @property
    def prefill_bootstrap_ports(self) -> list[int]:
        """Each prefill's registry: its embedded one, or the standalone one."""
        own = lambda p: p.arg("--bootstrap-port") or p.arg("--disaggregation-bootstrap-port")  # noqa: E731 (SGLang's)
        return [int(own(p) or self.bootstrap.port) for p in self.prefills]

    def spawn_router(self) -> None:
        pairs = list(zip(self.prefills, self.prefill_bootstrap_ports))
        self.router = spawn_router(pairs, self.decodes, *self.router_args, policy=self.policy)

    def wait_ready(self, timeout: float = 180.0) -> Cluster:
        """Every node ready, then the router (started again if a node moved ports: it was told the old ones)."""
        try:
            for node in self.nodes:
                node.wait_ready(timeout)
            if any(node.moves for node in self.nodes):
                self.router.stop()
                self.spawn_router()
            self.router.wait_ready()
            self.wait_all_healthy(timeout)
            return self
        except BaseException:
            self.stop()
            raise

    def wait_all_healthy(self, timeout: float) -> None:
        """The router ready means one healthy pair; a test of its policy needs every worker seen healthy."""
        deadline = time.monotonic() + timeout
        args = list(self.router_args)
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while True:
            workers = httpx.get(self.url + "/workers", headers=headers, timeout=10).json()["workers"]
            if len(workers) == len(self.nodes) and all(w["healthy"] for w in workers):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the router never saw every worker healthy: {workers}")
            time.sleep(0.1)

    def wait_idle(self) -> None:
        for node in self.nodes:
            node.wait_idle()

    def stop(self) -> None:
        for p in [self.router, *self.nodes, self.bootstrap]:
            if p is not None:
                p.stop()


def start_cluster(*args, ready_timeout: float = 180.0, **kwargs) -> Cluster:
    """spawn_cluster's cluster, all ready."""
    return spawn_cluster(*args, **kwargs).wait_ready(ready_timeout)


def spawn_cluster(
    backend: str = "mooncake",
    n_prefill: int = 1,
    n_decode: int = 1,
    flags: tuple[str, ...] = (),
    decode_flags: tuple[str, ...] = (),
    policy: str = "round_robin",
    prefill_flags: tuple[str, ...] = (),
    router_flags: tuple[str, ...] = (),
    standalone_bootstrap: bool = False,
) -> Cluster:
    """Prefills (each with its embedded bootstrap registry, or all registered with one standalone
    `tandem bootstrap`), decodes and a router, all started at once (tests/ports.py); call wait_ready()."""
    c = Cluster(policy=policy, router_args=("--health-check-interval-s", "0.5", *router_flags))
    try:
        if standalone_bootstrap:
            port = free_port()
            c.bootstrap = ServerProcess(["bootstrap", "--port", str(port)], port, name="bootstrap").wait_ready(60)
        for i in range(n_prefill):
            where = ("--bootstrap-url", c.bootstrap.url) if c.bootstrap else ("--bootstrap-port", str(free_port()))
            mode = ("--disaggregation-mode", "prefill", "--transfer-backend", backend, *where)
            c.prefills.append(start_server(*mode, *flags, *prefill_flags, name=f"prefill{i}"))
        for j in range(n_decode):
            mode = ("--disaggregation-mode", "decode", "--transfer-backend", backend)
            c.decodes.append(start_server(*mode, *flags, *decode_flags, name=f"decode{j}"))
        c.spawn_router()
        return c
    except BaseException:
        c.stop()
        raise


def generate(url: str, ids: list[int], max_new: int = 16, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **extra.pop("sampling", {})},
        **extra,
    }
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def start_router(
    prefills: list[tuple[ServerProcess, int]],
    decodes: list[ServerProcess],
    *flags: str,
    policy: str = "round_robin",
    name: str = "router",
) -> ServerProcess:
    """A router over running workers: `prefills` are (server, bootstrap port) pairs; waits until it has a
    healthy pair."""
    return spawn_router(prefills, decodes, *flags, policy=policy, name=name).wait_ready(60)


def spawn_router(
    prefills: list[tuple[ServerProcess, int]],
    decodes: list[ServerProcess],
    *flags: str,
    policy: str = "round_robin",
    name: str = "router",
) -> ServerProcess:
    """start_router's router, not waited for: it is ready once it has a healthy pair."""
    port = free_port()
    prefill_args = [a for p, boot in prefills for a in ("--prefill", p.url, str(boot))]
    decode_args = [a for d in decodes for a in ("--decode", d.url)]
    return ServerProcess(
        ["router", *prefill_args, *decode_args, "--port", str(port), "--policy", policy, *flags],
        port,
        name=name,
        health="/readiness",
    )

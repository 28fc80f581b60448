"""A local PD cluster for tests: prefill servers (embedded bootstrap), decode servers and the router,
each a real process on 127.0.0.1."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from tests.conftest import ServerProcess, free_port, start_server


@dataclass
class Cluster:
    prefills: list[ServerProcess] = field(default_factory=list)
    decodes: list[ServerProcess] = field(default_factory=list)
    router: ServerProcess | None = None
    prefill_bootstrap_ports: list[int] = field(default_factory=list)
    bootstrap: ServerProcess | None = None  # a standalone registry shared by every prefill, if any

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def nodes(self) -> list[ServerProcess]:
        return self.prefills + self.decodes

    def wait_idle(self) -> None:
        for node in self.nodes:
            node.wait_idle()

    def stop(self) -> None:
        for p in [self.router, *self.nodes, self.bootstrap]:
            if p is not None:
                p.stop()


def start_cluster(
    backend: str = "mooncake",
    n_prefill: int = 1,
    n_decode: int = 1,
    flags: tuple[str, ...] = (),
    decode_flags: tuple[str, ...] = (),
    policy: str = "round_robin",
    prefill_flags: tuple[str, ...] = (),
    router_flags: tuple[str, ...] = (),
    standalone_bootstrap: bool = False,
    ready_timeout: float = 180.0,
) -> Cluster:
    """Prefills (each with its embedded bootstrap registry, or all registered with one standalone
    `tandem bootstrap`), decodes and a router, all ready."""
    c = Cluster()
    try:
        prefill_args = []
        if standalone_bootstrap:
            port = free_port()
            c.bootstrap = ServerProcess(["bootstrap", "--port", str(port)], port, name="bootstrap").wait_ready(60)
        for i in range(n_prefill):
            boot = c.bootstrap.port if c.bootstrap else free_port()
            where = ("--bootstrap-url", c.bootstrap.url) if c.bootstrap else ("--bootstrap-port", str(boot))
            c.prefill_bootstrap_ports.append(boot)
            c.prefills.append(
                start_server(
                    "--disagg-mode",
                    "prefill",
                    "--transfer-backend",
                    backend,
                    *where,
                    *flags,
                    *prefill_flags,
                    name=f"prefill{i}",
                )
            )
            prefill_args += ["--prefill", c.prefills[-1].url, str(boot)]
        for j in range(n_decode):
            c.decodes.append(
                start_server(
                    "--disagg-mode", "decode", "--transfer-backend", backend, *flags, *decode_flags, name=f"decode{j}"
                )
            )
        for node in c.nodes:
            node.wait_ready(ready_timeout)
        port = free_port()
        decode_args = [a for d in c.decodes for a in ("--decode", d.url)]
        c.router = ServerProcess(
            [
                "router",
                *prefill_args,
                *decode_args,
                "--port",
                str(port),
                "--policy",
                policy,
                "--health-check-interval-s",
                "0.5",
                *router_flags,
            ],
            port,
            name="router",
            health="/readiness",
        ).wait_ready()
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
    port = free_port()
    prefill_args = [a for p, boot in prefills for a in ("--prefill", p.url, str(boot))]
    decode_args = [a for d in decodes for a in ("--decode", d.url)]
    return ServerProcess(
        ["router", *prefill_args, *decode_args, "--port", str(port), "--policy", policy, *flags],
        port,
        name=name,
        health="/readiness",
    ).wait_ready(60)

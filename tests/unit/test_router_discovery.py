"""Router discovery without a cluster: an injected resolver stands in for DNS; exact add/remove sets."""

from __future__ import annotations

import asyncio
import socket

import pytest

from router.discovery import Discovery, Target, resolve, targets_from_config
from router.workers import WorkerRegistry
from tandem.router_cli import config_from_args


class FakeDNS:
    """name -> addresses, changed by the test between rounds; a LookupError entry fails the lookup."""

    def __init__(self, answers: dict[str, list[str] | LookupError]):
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.answers.get(host, [])
        if isinstance(answer, LookupError):
            raise answer
        return answer


def test_workers_appear_and_vanish_with_their_dns_records():
    async def scenario() -> None:
        registry = WorkerRegistry(failure_threshold=2)
        registry.add("http://10.0.0.9:30000", "decode")  # given by hand: discovery must leave it alone
        dns = FakeDNS({"p.svc": ["10.0.0.1", "10.0.0.2"], "d.svc": ["10.0.1.1", "10.0.0.9"]})
        targets = [Target("prefill", "p.svc", 30000, 8998, "boot.svc"), Target("decode", "d.svc", 30000)]
        discovery = Discovery(registry, targets, dns)

        added, removed = await discovery.refresh()
        assert added == {"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.1.1:30000"} and removed == set()
        assert dns.asked == [("p.svc", 30000), ("d.svc", 30000)]
        p1 = registry.workers["http://10.0.0.1:30000"]
        assert (p1.role, p1.bootstrap_port, p1.bootstrap_host, p1.registry_host) == (
            "prefill",
            8998,
            "boot.svc",
            "boot.svc",
        )
        assert registry.workers["http://10.0.1.1:30000"].role == "decode"

        dns.answers = {"p.svc": ["10.0.0.2", "10.0.0.3"], "d.svc": []}  # a prefill replaced, every decode gone
        added, removed = await discovery.refresh()
        assert added == {"http://10.0.0.3:30000"}
        assert removed == {"http://10.0.0.1:30000", "http://10.0.1.1:30000"}
        assert sorted(registry.workers) == ["http://10.0.0.2:30000", "http://10.0.0.3:30000", "http://10.0.0.9:30000"]

        dns.answers = {"p.svc": LookupError("resolving p.svc: temporary failure"), "d.svc": ["10.0.1.2"]}
        added, removed = await discovery.refresh()  # a failed lookup keeps what that name had
        assert added == {"http://10.0.1.2:30000"} and removed == set()
        assert sorted(registry.workers) == [
            "http://10.0.0.2:30000",
            "http://10.0.0.3:30000",
            "http://10.0.0.9:30000",
            "http://10.0.1.2:30000",
        ]

        assert await discovery.refresh() == (set(), set())  # nothing changed: nothing to do

    asyncio.run(scenario())


def test_a_prefill_without_a_standalone_registry_is_looked_up_at_its_own_address():
    async def scenario() -> None:
        registry = WorkerRegistry(failure_threshold=2)
        discovery = Discovery(
            registry,
            [Target("prefill", "p", 8080, 9000), Target("decode", "d", 8081)],
            FakeDNS({"p": ["fd00::5"], "d": ["10.1.1.1"]}),
        )
        assert await discovery.refresh() == ({"http://[fd00::5]:8080", "http://10.1.1.1:8081"}, set())
        prefill = registry.workers["http://[fd00::5]:8080"]
        assert (prefill.bootstrap_port, prefill.registry_host) == (9000, "fd00::5")

    asyncio.run(scenario())


def test_targets_come_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_DECODE_DISCOVERY", "tandem-decode.llm.svc.cluster.local:30000")
    config = config_from_args(
        [
            "--prefill-discovery",
            "tandem-prefill.llm.svc.cluster.local:30000",
            "--prefill-bootstrap-port",
            "9998",
            "--prefill-bootstrap-host",
            "tandem-bootstrap",
            "--discovery-interval-s",
            "2",
        ]
    )
    assert targets_from_config(config) == [
        Target("prefill", "tandem-prefill.llm.svc.cluster.local", 30000, 9998, "tandem-bootstrap"),
        Target("decode", "tandem-decode.llm.svc.cluster.local", 30000),
    ]
    assert config.discovery_interval_s == 2.0
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        config_from_args(["--decode-discovery", "tandem-decode"])


def test_a_static_prefill_names_its_standalone_registry():
    config = config_from_args(["--prefill", "http://p:30000", "boot.svc:8998", "--prefill", "http://q:30000", "none"])
    assert [(p.url, p.bootstrap_host, p.bootstrap_port) for p in config.prefill] == [
        ("http://p:30000", "boot.svc", 8998),
        ("http://q:30000", None, None),
    ]


def test_resolve_prefers_ipv4_and_tells_a_missing_name_from_a_failed_lookup(monkeypatch):
    assert asyncio.run(resolve("localhost", 80)) == ["127.0.0.1"]  # not ::1 too: one worker, one URL

    def failing(errno: int):
        def getaddrinfo(*_args, **_kwargs):
            raise socket.gaierror(errno, "test")

        return getaddrinfo

    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_NONAME))
    assert asyncio.run(resolve("gone.svc", 80)) == []
    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_AGAIN))
    with pytest.raises(LookupError, match="resolving gone.svc"):
        asyncio.run(resolve("gone.svc", 80))

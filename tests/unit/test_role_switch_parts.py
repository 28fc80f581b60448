"""The parts of a role switch that need no server: one transfer engine kept across roles (each range registered
once, a role's close leaving it open), a router following a worker's role and registry from its /health, a server
refusing a half meant for the other role, and the router following that refusal."""

from __future__ import annotations

import json
from types import SimpleNamespace

from common.http.role_guard import role_refusal
from router.http1 import Response
from router.upstream import CLIENT_ERROR, DECODE_FAILED, answered
from router.workers import WorkerRegistry
from transfer.backends.loopback import LoopbackBackend
from transfer.backends.shared import SharedBackend


class CountingBackend(LoopbackBackend):
    def __init__(self) -> None:
        super().__init__()
        self.registrations: list[tuple[int, int]] = []
        self.closed = False

    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        self.registrations.append((ptr, nbytes))
        super().register(ptr, nbytes, on_device)

    def close(self) -> None:
        self.closed = True


def test_the_shared_engine_is_made_once_registers_each_range_once_and_outlives_a_role():
    shared, made = SharedBackend(), []

    def make() -> CountingBackend:
        made.append(CountingBackend())
        return made[-1]

    for _ in range(2):  # a prefill role, then a decode role
        backend = shared.bind(make)
        backend.register(4096, 1024)
        backend.close()
    shared.bind(make).register(8192, 64)  # the decode's aux buffer
    shared.add_peer("self", shared.address(), device_index=0)  # the engine's own arguments pass through
    assert len(made) == 1 and made[0].registrations == [(4096, 1024), (8192, 64)]
    assert not made[0].closed
    shared.shutdown()
    assert made[0].closed


def test_the_router_follows_a_workers_role_and_registry():
    registry = WorkerRegistry(failure_threshold=1)
    w = registry.add("http://10.0.0.5:30000", "decode")
    registry.follow_role(w, "prefill", "10.0.0.5:8998")
    assert (w.role, w.bootstrap_port, w.bootstrap_host, w.registry_host) == ("prefill", 8998, None, "10.0.0.5")
    registry.follow_role(w, "prefill", "boot.svc:9000")  # a standalone registry
    assert (w.bootstrap_port, w.registry_host) == (9000, "boot.svc")
    registry.follow_role(w, "decode", None)
    registry.follow_role(w, None, None)  # an old server names no role: kept
    registry.follow_role(w, "router", None)  # not a worker role: ignored
    assert w.role == "decode"


def test_a_server_refuses_a_half_meant_for_the_other_role_and_a_bad_role_names_the_header():
    engine = SimpleNamespace(mode="prefill")
    assert role_refusal(engine, "prefill") is None
    refused = role_refusal(engine, "decode")
    assert (refused.status, refused.param) == (409, "X-Tandem-Role") and "a prefill server, not a decode" in str(
        refused
    )
    bad = role_refusal(engine, "router")
    assert (bad.status, bad.param) == (400, "X-Tandem-Role")


def answer(status: int, headers: dict[str, str], body: dict) -> tuple[Response, bytes]:
    resp = Response(None, b"", 1.0)
    resp.status, resp.headers = status, [(k.encode(), v.encode()) for k, v in headers.items()]
    return resp, json.dumps(body).encode()


def test_the_router_follows_a_refusal_of_the_role_it_meant_and_retries_it():
    registry = WorkerRegistry(failure_threshold=1)
    w = registry.add("http://10.0.0.5:30000", "decode")
    body = {"error": {"message": "this server is a prefill server", "type": "conflict_error", "code": 409}}
    headers = {"X-Tandem-Role": "prefill", "X-Tandem-Instance-Id": "p-2", "X-Tandem-Bootstrap": "10.0.0.5:8998"}
    resp, raw = answer(409, headers, body)
    error = answered(resp, w, raw)
    assert (error.status, error.cause, error.retriable, error.body) == (409, DECODE_FAILED, True, body)
    registry.follow(w, error.role_headers.get)
    assert (w.role, w.instance_id, w.bootstrap_port, w.recomputes) == ("prefill", "p-2", 8998, False)
    resp, raw = answer(409, {}, body)  # a conflict of the client's request, not of the role
    plain = answered(resp, w, raw)
    assert (plain.cause, plain.retriable, plain.role_headers) == (CLIENT_ERROR, False, None)

"""Talking to one worker: POST, read the answer, and turn every way that can fail into an
UpstreamError that carries what the client gets (status + JSON error body) and why (the cause that
metrics count).

    failure                                   status  body                       retried  cause / upstream error
    worker answered 4xx (the client's error)  its own its own JSON error         no       client_error / no
    worker answered 401/403 (refused the      502     names the worker, the key  no       its half / yes
      router's key for its workers)
    worker answered 429, 503 or 5xx           its own its own JSON error         429/503  its half / yes
    worker refused the role the router meant  409     its own JSON error         always   its half / yes
      (409 with X-Tandem-Role: a role switch
      changed it; the router follows it)
    connection refused                        502     names the worker + cause   yes      yes
    connection dropped / reset mid-answer     502     names the worker + cause   no       yes
    timeout                                   502     names the worker + cause   no       its half / yes
    worker taken out of rotation (health)     502     names the worker + reason  no       worker_dead / yes

"Its half" is the cause prefill_failed or decode_failed; only connection failures other than timeouts count
towards taking the worker out of rotation. A refused role is retried however often (each refusal changes the
worker's role in the registry, and the request avoids that worker from then on).

A client that goes away is no UpstreamError: its handler is cancelled (router/dispatch.py counts it).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from common.wire.api import BOOTSTRAP_HEADER, INSTANCE_HEADER, RECOMPUTE_HEADER, ROLE_HEADER
from common.wire.errors import error_body
from router.http1 import ConnectFailed, Response
from router.workers import Worker

PREFILL_FAILED, DECODE_FAILED = "prefill_failed", "decode_failed"
WORKER_DEAD, CLIENT_DISCONNECTED, CLIENT_ERROR = "worker_dead", "client_disconnected", "client_error"
RETRY_STATUSES = frozenset({429, 503})  # the worker is alive but refuses more work: another pair may take it
KEY_REFUSED = frozenset({401, 403})  # the worker refused the router's key: the router's setup, not the client
ROLE_HEADERS = (ROLE_HEADER, INSTANCE_HEADER, BOOTSTRAP_HEADER, RECOMPUTE_HEADER)  # what a worker says of its role


class UpstreamError(Exception):
    """One request through a (prefill, decode) pair ended early; the other half must be cancelled."""

    def __init__(
        self,
        status: int,
        body: dict[str, Any],
        cause: str,
        worker: Worker | None = None,
        retriable: bool = False,
        worker_failed: bool = False,
        headers: dict[str, str] | None = None,
        movable: bool = True,
        role_headers: dict[str, str | None] | None = None,
    ):
        super().__init__(body["error"]["message"])
        self.status, self.body, self.cause, self.worker = status, body, cause, worker
        self.headers = headers or {}  # for the client, e.g. the worker's Retry-After
        self.retriable = retriable  # nothing reached the client or the worker: another pair may be tried
        self.worker_failed = worker_failed  # counts towards taking the worker out of rotation
        self.movable = movable  # another pair may serve it (router/migration.py); not when the router's setup is wrong
        # a refusal of the role the router meant the half for: the worker's role headers, which the router follows
        self.role_headers = role_headers

    @property
    def upstream(self) -> bool:
        """Whether a worker is at fault (an upstream error); else the client's request was wrong."""
        return self.worker is not None and self.cause != CLIENT_ERROR


def half_cause(worker: Worker) -> str:
    return PREFILL_FAILED if worker.role == "prefill" else DECODE_FAILED


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def answered_error(worker: Worker, status: int, raw: bytes, retry_after: str | None = None) -> UpstreamError:
    """The worker's own error status and JSON body, passed through unchanged when it is an error body;
    an overloaded worker's Retry-After goes along. A 4xx is the client's error (its cause is client_error),
    but 429 and a refused key."""
    if status in KEY_REFUSED:
        return key_refused(worker, status)
    try:
        body = json.loads(raw)
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict) or "message" not in body["error"]:
            raise ValueError("not an error body")
    except ValueError:
        text = raw[:200].decode(errors="replace")
        body = error_body(f"{worker.role} worker {worker.url} answered HTTP {status}: {text}", "upstream_error", status)
    retriable = status in RETRY_STATUSES
    headers = {"Retry-After": retry_after or "1"} if retriable else None
    cause = CLIENT_ERROR if 400 <= status < 500 and not retriable else half_cause(worker)
    return UpstreamError(status, body, cause, worker, retriable=retriable, headers=headers)


def answered(resp: Response, worker: Worker, raw: bytes) -> UpstreamError:
    """The error of a worker's answer other than 200 (`raw` its body): a refusal of the role the router meant the half
    for (409 naming the worker's role: common/http/role_guard.py), or the worker's own error (answered_error)."""
    error = answered_error(worker, resp.status, raw, resp.header("retry-after"))
    if resp.status != 409 or resp.header(ROLE_HEADER) is None:
        return error
    role_headers = {name: resp.header(name) for name in ROLE_HEADERS}
    return UpstreamError(409, error.body, half_cause(worker), worker, retriable=True, role_headers=role_headers)


def key_refused(worker: Worker, status: int) -> UpstreamError:
    message = (
        f"{worker.role} worker {worker.url} refused the router's key (HTTP {status}): give the router the "
        "workers' key (--api-key, or --worker-api-key when it differs from the clients' key)"
    )
    return UpstreamError(502, error_body(message, "upstream_error", 502), half_cause(worker), worker, movable=False)


def connection_failed(worker: Worker, exc: BaseException, when: str) -> UpstreamError:
    """A connection-level failure (refused, reset, dropped, timed out): 502 naming the worker and the cause."""
    refused = isinstance(exc, ConnectFailed)
    timed_out = isinstance(exc, asyncio.TimeoutError)
    what = "refused the connection" if refused else f"failed {when}"
    message = f"{worker.role} worker {worker.url} {what}: {describe_error(exc)}"
    return UpstreamError(
        502,
        error_body(message, "upstream_error", 502),
        half_cause(worker),
        worker,
        retriable=refused,
        worker_failed=not timed_out,
    )


def worker_dead(worker: Worker) -> UpstreamError:
    message = f"request cancelled: {worker.down_reason}"
    return UpstreamError(502, error_body(message, "upstream_unavailable", 502), WORKER_DEAD, worker)


async def send(resp: Response, worker: Worker) -> Response:
    """Send the request and return once the answer's headers arrived; an error status or a failed connection
    raises UpstreamError."""
    try:
        await resp.send()
    except (ConnectionError, asyncio.TimeoutError) as e:
        raise connection_failed(worker, e, "before answering") from None
    if resp.status == 200:
        return resp
    raise answered(resp, worker, await read_all(resp, worker))


def answer_error(resp: Response, worker: Worker) -> UpstreamError | None:
    """What went wrong with a finished answer (complete or failed), or None for a complete 200."""
    if isinstance(resp.error, UpstreamError):  # ended from outside: the call already has its error
        return resp.error
    if isinstance(resp.error, (ConnectionError, asyncio.TimeoutError)):
        return connection_failed(worker, resp.error, "while answering" if resp.status else "before answering")
    if resp.status != 200:
        return answered(resp, worker, resp.body())
    return None


async def read_all(resp: Response, worker: Worker) -> bytes:
    """The whole body; the connection is closed if this does not finish (error or cancellation)."""
    try:
        return await resp.read()
    except (ConnectionError, asyncio.TimeoutError) as e:
        raise connection_failed(worker, e, "while answering") from None
    finally:
        resp.close()  # after a complete read the connection is already back in the pool; this is a no-op then


async def read_chunk(resp: Response, worker: Worker) -> bytes:
    """The next bytes of a streamed body; b"" at its end."""
    try:
        return await resp.chunk()
    except (ConnectionError, asyncio.TimeoutError) as e:
        raise connection_failed(worker, e, "mid-stream") from None

"""The engine servers' deadline on the request head (common/edge/head_deadline.py), on a real uvicorn server
in this process with the deadline shortened to DEADLINE_S (`--head-timeout-s`, as a server's config sets it):
what is closed when, and what is left alone; the default, 30 s, on the servers and the router."""

from __future__ import annotations

import asyncio
import time

import uvicorn

from common.config import ServerConfig
from common.edge.head_deadline import with_head_deadline
from common.wire.body import ARRIVAL_TIMEOUT_S
from router.config import RouterConfig
from tests.conftest import free_port

DEADLINE_S = 0.5
PARTIAL_HEAD = b"POST /generate HTTP/1.1\r\nHost: x\r\n"
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


ShortDeadline = with_head_deadline(DEADLINE_S)


def test_the_deadline_is_30_s_unless_set():
    assert ServerConfig().head_timeout_s == RouterConfig().head_timeout_s == ARRIVAL_TIMEOUT_S == 30.0
    assert ShortDeadline.head_timeout_s == DEADLINE_S and with_head_deadline(30.0).head_timeout_s == 30.0


async def app(scope, receive, send) -> None:
    """Answers "ok" at once, or after 2 deadlines for GET /slow."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * DEADLINE_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def with_server(scenario) -> None:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, http=ShortDeadline, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        await scenario(port)
    finally:
        server.should_exit = True
        await task


async def closed_after(reader: asyncio.StreamReader, start: float) -> float:
    """Seconds from `start` until the server closed the connection (having sent nothing more)."""
    assert await asyncio.wait_for(reader.read(), 5) == b""
    return time.monotonic() - start


async def answer(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0] + b" " + await reader.readexactly(2)


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline():
    async def scenario(port: int) -> None:
        start = time.monotonic()
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        assert DEADLINE_S <= await closed_after(reader, start) < DEADLINE_S + 0.4

    asyncio.run(with_server(scenario))


def test_a_partial_head_is_closed_at_the_deadline_counted_from_the_connection_start():
    async def scenario(port: int) -> None:
        start = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(DEADLINE_S / 2)
        writer.write(PARTIAL_HEAD)
        assert DEADLINE_S <= await closed_after(reader, start) < DEADLINE_S + 0.4

    asyncio.run(with_server(scenario))


def test_a_partial_head_after_a_response_is_closed_at_the_deadline_counted_from_that_response():
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(DEADLINE_S / 2)
        writer.write(GET)
        assert await answer(reader) == b"HTTP/1.1 200 OK ok"
        answered = time.monotonic()
        writer.write(PARTIAL_HEAD)
        assert DEADLINE_S <= await closed_after(reader, answered) < DEADLINE_S + 0.4

    asyncio.run(with_server(scenario))


def test_a_request_in_progress_at_the_deadline_is_answered_and_its_connection_kept():
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await answer(reader) == b"HTTP/1.1 200 OK ok"
        writer.write(GET)
        assert await answer(reader) == b"HTTP/1.1 200 OK ok"
        writer.close()

    asyncio.run(with_server(scenario))

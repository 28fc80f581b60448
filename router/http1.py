"""The router's HTTP/1.1 client for the request path: one pool of keep-alive connections per worker, each
request written in one piece, each answer parsed as it arrives (Content-Length, chunked, or until close).

Why not aiohttp's client: it costs 80-100 µs of CPU per request on a 2-core machine where this costs 10-20,
and the router makes two requests per client request (benchmarks/router_bench.py has the numbers). Workers
need none of what it adds (redirects, cookies, proxies, compression). Health checks still use aiohttp.

Failures: `ConnectFailed` when no connection could be made (nothing reached the worker), `ConnectionLost`
when the connection broke or the answer was malformed before it was complete, `asyncio.TimeoutError` past
the request's deadline. An incomplete answer never goes back to the pool: closing it closes its
connection, which aborts the request on the worker.
"""
from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

from router.http1_conn import Connection, ConnectionLost, header_value

HIGH_WATER = 1 << 20  # unread answer bytes beyond this pause reading from the worker
MAX_IDLE = 256  # idle connections kept per worker
CONNECT_TIMEOUT_S = 5.0


class ConnectFailed(ConnectionError):
    """No connection could be made (refused, unreachable, TLS failed): the worker got nothing."""


__all__ = ["ConnectFailed", "ConnectionLost", "Pool", "Response"]


class Response:
    """One request's answer: `status` and `header(name)` once `send()` returned, then the body through `read()`
    or `chunk()`. `fail(exc)` ends it from outside: every wait raises `exc` from then on."""

    def __init__(self, pool: Pool, data: bytes, timeout: float) -> None:
        self.pool, self.data, self.timeout = pool, data, timeout
        self.status = 0
        self.head = b""  # the answer's status line and headers
        self.complete = False
        self.error: BaseException | None = None
        self.conn: Connection | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def send(self) -> Response:
        """Write the request and wait for the answer's status and headers. A pooled connection that the
        worker closed before answering anything is replaced once: a worker may close an idle connection
        just as it is reused, and then it never saw the request."""
        if self.error is not None:  # failed before it was sent: send nothing
            raise self.error
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.timeout, self.fail, asyncio.TimeoutError())
        if self.pool.idle:
            conn = self.pool.idle.pop()
            try:
                return await self._exchange(conn)
            except ConnectionLost:
                if not conn.nothing_received:
                    raise
                self.error, self._timer = None, loop.call_later(self.timeout, self.fail, asyncio.TimeoutError())
        conn = await self.pool.connect()
        if self.error is not None:  # failed from outside while connecting
            self.pool.release(conn)
            raise self.error
        return await self._exchange(conn)

    async def _exchange(self, conn: Connection) -> Response:
        conn.start(self)
        while not self.status:
            await self._wait()
        return self

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at the end."""
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            await self._wait()
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self.conn is not None:
            self.conn.resume()
        return data

    def header(self, name: str) -> str | None:
        """A header's value (the first of its name), or None."""
        value = header_value(self.head.lower(), name.lower().encode())
        return None if value is None else self.head[value[0] : value[1]].decode("latin-1").strip()

    def close(self) -> None:
        """Done with this answer: an incomplete one closes its connection (aborting the request there), and
        one not sent yet never will be."""
        if not self.complete:
            self.fail(ConnectionLost("closed before the answer was complete"))
        self._stop_timer()

    def fail(self, exc: BaseException) -> None:
        """End the answer with `exc` (the first failure wins) and close its connection."""
        if self.complete or self.error is not None:
            return
        self.error = exc
        self._stop_timer()
        if self.conn is not None:
            self.conn.abort()
        self._wake()

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None and not self._chunks:
            raise self.error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # called by the connection
    def _start(self, status: int, head: bytes) -> None:
        self.status, self.head = status, head
        self._wake()

    def _feed(self, data: bytes) -> bool:
        """Buffer body bytes; False when the reader is this far behind and reading should pause."""
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()
        return self._buffered < HIGH_WATER

    def _end(self) -> None:
        self.complete = True
        self.conn = None
        self._stop_timer()
        self._wake()


class Pool:
    """Keep-alive connections to one worker (`http://host:port` or `https://...`)."""

    def __init__(self, base_url: str) -> None:
        u = urlsplit(base_url)
        self.host, self.tls = u.hostname or "127.0.0.1", u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.host_header = f"Host: {u.netloc}\r\n".encode()
        self.idle: list[Connection] = []

    def post(self, path: str, body: bytes, timeout: float) -> Response:
        """A POST of a JSON body, not yet sent: call `send()` on it."""
        head = (b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\n" + self.host_header +
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        return Response(self, head + body, timeout)

    async def connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: Connection(self), self.host, self.port, ssl=ssl.create_default_context() if self.tls else None),
                CONNECT_TIMEOUT_S)
        except OSError as e:
            raise ConnectFailed(f"{type(e).__name__}: {e}") from None
        return conn

    def release(self, conn: Connection) -> None:
        if conn.open and len(self.idle) < MAX_IDLE:
            self.idle.append(conn)
        else:
            conn.abort()

    def discard(self, conn: Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()

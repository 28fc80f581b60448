"""The router's HTTP/1.1 client for the request path: one pool of keep-alive connections per worker, each
request written in one piece, each answer parsed by httptools as it arrives (router/http1_conn.py). Every
request carries the router's key for its workers (`Authorization: Bearer`) when it has one; `https://`
workers are verified with the router's TLS client context.

Why not aiohttp's client: it costs 80-100 µs of CPU per request on a 2-core machine where this costs 10-20,
and the router makes two requests per client request (benchmarks/router_bench.py has the numbers). Workers
need none of what it adds (redirects, cookies, proxies, compression). Health checks still use aiohttp.

Failures: `ConnectFailed` when no connection could be made within CONNECT_TIMEOUT_S (nothing reached the
worker), `ConnectionLost` when the connection broke or the answer was malformed before it was complete,
`asyncio.TimeoutError` past the request's deadline. An incomplete answer never goes back to the pool:
closing it closes its connection, which aborts the request on the worker.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

from router.http1_conn import Connection, ConnectionLost

HIGH_WATER = 1 << 20  # unread answer bytes beyond this pause reading from the worker
MAX_IDLE = 256  # idle connections kept per worker
CONNECT_TIMEOUT_S = 5.0


class ConnectFailed(ConnectionError):
    """No connection could be made (refused, unreachable, timed out, TLS failed): the worker got nothing."""


__all__ = ["ConnectFailed", "ConnectionLost", "Pool", "Pools", "Response"]


class Response:
    """One request's answer. `start()` sends the request; `status` and `header(name)` are there once `send()`
    returned, then the body through `read()` or `chunk()`; or `on_done(self)` is called once the answer is
    complete or failed, with the body in `body()`. `fail(exc)` ends it from outside: every wait raises `exc`
    from then on. A pooled connection that the worker closed before answering anything is replaced once (a
    worker may close an idle connection just as it is reused; it never saw the request)."""

    def __init__(self, pool: Pool, data: bytes, timeout: float, on_done: Callable[[Response], None] | None = None):
        self.pool, self.data, self.timeout, self.on_done = pool, data, timeout, on_done
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # the answer's, as sent
        self.complete = False
        self.error: BaseException | None = None
        self.conn: Connection | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._connecting: asyncio.Task | None = None

    def start(self) -> None:
        """Send the request: now on a pooled connection, else as soon as a new one is made."""
        if self.error is not None:  # failed before it was sent: send nothing
            return
        self._timer = asyncio.get_running_loop().call_later(self.timeout, self.fail, asyncio.TimeoutError())
        if self.pool.idle:
            self.pool.idle.pop().start(self)
        else:
            self._connecting = asyncio.ensure_future(self._connect())

    async def send(self) -> Response:
        """Send the request and wait for the answer's status and headers."""
        self.start()
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
        data = self.body()
        if self.conn is not None:
            self.conn.resume()
        return data

    def body(self) -> bytes:
        """The body bytes not read yet (all of them, once complete)."""
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    def header(self, name: str) -> str | None:
        """A header's value (the first of its name), or None."""
        low = name.lower().encode()
        for key, value in self.headers:
            if key.lower() == low:
                return value.decode("latin-1").strip()
        return None

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
        if self._connecting is not None:
            self._connecting.cancel()
        if self.conn is not None:
            self.conn.abort()
        self._wake()
        self._done()

    async def _connect(self) -> None:
        try:
            conn = await self.pool.connect()
        except (ConnectFailed, asyncio.TimeoutError) as e:
            self.fail(e)
            return
        if self.error is not None:  # failed from outside while connecting
            self.pool.release(conn)
            return
        conn.start(self)

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

    def _done(self) -> None:
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done(self)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # called by the connection
    def _resend(self) -> None:
        """The pooled connection closed before any byte of the answer: send again on a new one."""
        self.conn = None
        self._connecting = asyncio.ensure_future(self._connect())

    def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.headers = status, headers
        self._wake()

    def _feed(self, data: bytes) -> bool:
        """Buffer body bytes; False when a reader of chunks is this far behind and reading should pause (an
        answer collected whole for `on_done` has no reader to resume it: it never pauses)."""
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()
        return self.on_done is not None or self._buffered < HIGH_WATER

    def _end(self) -> None:
        self.complete = True
        self.conn = None
        self._stop_timer()
        self._wake()
        self._done()


class Pool:
    """Keep-alive connections to one worker (`http://host:port` or `https://...`); `headers` are sent with
    every request (CRLF-terminated lines), `tls` verifies an https worker (default: the system's CAs), whose
    certificate must name `tls_name` (default: the URL's host)."""

    def __init__(
        self, base_url: str, headers: bytes = b"", tls: ssl.SSLContext | None = None, tls_name: str | None = None
    ) -> None:
        u = urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.tls = (tls or ssl.create_default_context()) if u.scheme == "https" else None
        self.tls_name = tls_name if self.tls else None
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.headers = f"Host: {u.netloc}\r\n".encode() + headers
        self.idle: list[Connection] = []

    def post(
        self,
        path: str,
        body: bytes,
        timeout: float,
        on_done: Callable[[Response], None] | None = None,
        headers: bytes = b"",
    ) -> Response:
        """A POST of a JSON body, not yet sent: call `send()` or `start()` on it. `headers`: this request's own
        (CRLF-terminated lines) beside the pool's."""
        head = (
            b"POST "
            + (self.prefix + path).encode()
            + b" HTTP/1.1\r\n"
            + self.headers
            + headers
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        return Response(self, head + body, timeout, on_done)

    async def connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self.tls, server_hostname=self.tls_name
                ),
                CONNECT_TIMEOUT_S,
            )
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


class Pools:
    """Every worker's pool, made on first use: each sends `api_key` (the router's key for its workers) and
    verifies https workers with `tls`."""

    def __init__(self, api_key: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.headers = b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b""
        self.tls = tls
        self.by_url: dict[str, Pool] = {}

    def get(self, url: str, tls_name: str | None = None) -> Pool:
        pool = self.by_url.get(url)
        if pool is None:
            pool = self.by_url[url] = Pool(url, self.headers, self.tls, tls_name)
        return pool

    def close(self) -> None:
        for pool in self.by_url.values():
            pool.close()

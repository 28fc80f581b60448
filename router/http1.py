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

MAX_HEAD_BYTES = 64 * 1024
HIGH_WATER = 1 << 20  # unread answer bytes beyond this pause reading from the worker
MAX_IDLE = 256  # idle connections kept per worker
CONNECT_TIMEOUT_S = 5.0


class ConnectFailed(ConnectionError):
    """No connection could be made (refused, unreachable, TLS failed): the worker got nothing."""


class ConnectionLost(ConnectionError):
    """The connection closed, broke or carried a malformed answer before the answer was complete."""


class Response:
    """One request's answer: `status` and `header(name)` once `send()` returned, then the body through `read()`
    or `chunk()`. `fail(exc)` ends it from outside: every wait raises `exc` from then on."""

    def __init__(self, pool: Pool, data: bytes, timeout: float) -> None:
        self.pool, self.data, self.timeout = pool, data, timeout
        self.status = 0
        self.head = b""  # the answer's status line and headers
        self.complete = False
        self.error: BaseException | None = None
        self.conn: _Conn | None = None
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

    async def _exchange(self, conn: _Conn) -> Response:
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
        value = _header_value(self.head.lower(), name.lower().encode())
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


def _header_value(low_head: bytes, name: bytes) -> tuple[int, int] | None:
    """Where the value of header `name` lies in a lower-cased head: (start, end), or None without it."""
    at = low_head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    end = low_head.find(b"\r\n", start)
    return start, len(low_head) if end < 0 else end


class Pool:
    """Keep-alive connections to one worker (`http://host:port` or `https://...`)."""

    def __init__(self, base_url: str) -> None:
        u = urlsplit(base_url)
        self.host, self.tls = u.hostname or "127.0.0.1", u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.host_header = f"Host: {u.netloc}\r\n".encode()
        self.idle: list[_Conn] = []

    def post(self, path: str, body: bytes, timeout: float) -> Response:
        """A POST of a JSON body, not yet sent: call `send()` on it."""
        head = (b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\n" + self.host_header +
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        return Response(self, head + body, timeout)

    async def connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Conn(self), self.host, self.port, ssl=ssl.create_default_context() if self.tls else None),
                CONNECT_TIMEOUT_S)
        except OSError as e:
            raise ConnectFailed(f"{type(e).__name__}: {e}") from None
        return conn

    def release(self, conn: _Conn) -> None:
        if conn.open and len(self.idle) < MAX_IDLE:
            self.idle.append(conn)
        else:
            conn.abort()

    def discard(self, conn: _Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()


class _Conn(asyncio.Protocol):
    """One connection: parses the answers to the requests it carries, one at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.open = True
        self.resp: Response | None = None
        self.buf = bytearray()
        self.nothing_received = True
        self.state = "idle"  # head | length | chunk_size | chunk_data | chunk_end | trailers | until_close
        self.remaining = 0
        self.keep_alive = True
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, resp: Response) -> None:
        self.resp, resp.conn = resp, self
        self.nothing_received, self.state = True, "head"
        self.transport.write(resp.data)

    def resume(self) -> None:
        if self.paused and self.open:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.resp is None:  # an idle connection has nothing to say: drop it
            self.abort()
            return
        self.nothing_received = False
        self.buf += data
        try:
            self._parse()
        except (ValueError, IndexError) as e:
            self.abort()
            self._lost(ConnectionLost(f"malformed HTTP answer: {e}"))

    def eof_received(self) -> bool:
        self._lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    def _lost(self, exc: BaseException | None) -> None:
        self.open = False
        self.pool.discard(self)
        resp, self.resp = self.resp, None
        if resp is None:
            return
        if self.state == "until_close" and exc is None:  # the close is the end of the body
            resp._end()
        else:
            why = f"{type(exc).__name__}: {exc}" if exc else "the worker closed the connection"
            resp.fail(exc if isinstance(exc, ConnectionLost) else ConnectionLost(why))

    def _parse(self) -> None:
        while self.resp is not None and (self.buf or self.state == "length" and self.remaining == 0):
            if not getattr(self, "_" + self.state)():
                return

    def _head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD_BYTES:
                raise ValueError("head too large")
            return False
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        status = int(head[9:12])
        if 100 <= status < 200:
            return True  # an interim answer (100 Continue): the real one follows
        low = head.lower()  # only the headers that frame the answer are looked at here: the rest on demand
        connection, encoding, length = (_header_value(low, name) for name in (b"connection", b"transfer-encoding", b"content-length"))
        close = connection is not None and b"close" in low[connection[0] : connection[1]]
        self.keep_alive = not close if head.startswith(b"HTTP/1.1") else connection is not None and not close
        if status in (204, 304):
            self.state, self.remaining = "length", 0
        elif encoding is not None and b"chunked" in low[encoding[0] : encoding[1]]:
            self.state = "chunk_size"
        elif length is not None:
            self.state, self.remaining = "length", int(low[length[0] : length[1]])
        else:
            self.state, self.keep_alive = "until_close", False
        self.resp._start(status, head)
        return True

    def _take(self, n: int) -> None:
        data = bytes(self.buf[:n])
        del self.buf[:n]
        self.remaining -= n
        if not self.resp._feed(data) and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def _length(self) -> bool:
        if self.remaining:
            self._take(min(self.remaining, len(self.buf)))
        if self.remaining == 0:
            self._done()
        return True

    def _until_close(self) -> bool:
        self.remaining = len(self.buf)
        self._take(len(self.buf))
        return False

    def _chunk_size(self) -> bool:
        end = self.buf.find(b"\r\n")
        if end < 0:
            if len(self.buf) > 1024:
                raise ValueError("chunk size line too long")
            return False
        self.remaining = int(bytes(self.buf[:end]).split(b";")[0], 16)
        del self.buf[: end + 2]
        self.state = "chunk_data" if self.remaining else "trailers"
        return True

    def _chunk_data(self) -> bool:
        self._take(min(self.remaining, len(self.buf)))
        if self.remaining == 0:
            self.state = "chunk_end"
        return True

    def _chunk_end(self) -> bool:
        if len(self.buf) < 2:
            return False
        if self.buf[:2] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        del self.buf[:2]
        self.state = "chunk_size"
        return True

    def _trailers(self) -> bool:
        end = self.buf.find(b"\r\n")
        if end < 0:
            return False
        del self.buf[: end + 2]
        if end == 0:
            self._done()
        return True

    def _done(self) -> None:
        resp, self.resp, self.state = self.resp, None, "idle"
        reusable = self.keep_alive and not self.buf
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        resp._end()
        if reusable:
            self.pool.release(self)
        else:
            self.abort()

"""One keep-alive connection of router/http1.py's pools: writes a request, parses its answer as the bytes
arrive (Content-Length, chunked, or until close) and hands the body to the request's Response."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.http1 import Pool, Response

MAX_HEAD_BYTES = 64 * 1024


class ConnectionLost(ConnectionError):
    """The connection closed, broke or carried a malformed answer before the answer was complete."""


def header_value(low_head: bytes, name: bytes) -> tuple[int, int] | None:
    """Where the value of header `name` lies in a lower-cased head: (start, end), or None without it."""
    at = low_head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    end = low_head.find(b"\r\n", start)
    return start, len(low_head) if end < 0 else end


class Connection(asyncio.Protocol):
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
        self.requests = 0  # carried so far, this one included

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, resp: Response) -> None:
        self.resp, resp.conn = resp, self
        self.nothing_received, self.state = True, "head"
        self.transport.write(resp.data)
        self.requests += 1

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
        elif self.requests > 1 and self.nothing_received and resp.error is None:
            resp._resend()  # the worker closed it while idle, as we reused it
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
        connection, encoding, length = (
            header_value(low, name) for name in (b"connection", b"transfer-encoding", b"content-length")
        )
        close = connection is not None and b"close" in low[connection[0] : connection[1]]
        self.keep_alive = not close if head.startswith(b"HTTP/1.1") else connection is not None and not close
        if status in (204, 304):
            self.state, self.remaining = "length", 0
        elif encoding is not None and b"chunked" in low[encoding[0] : encoding[1]]:
            self.state = "chunk_size"
        elif length is not None:
            self.state, self.remaining = "length", int(low[length[0] : length[1]])
            if self.remaining < 0:
                raise ValueError("negative Content-Length")
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

"""One keep-alive connection of router/http1.py's pools: writes a request and hands its answer to the request's
Response as the bytes arrive. httptools (llhttp, the parser uvicorn uses) does the parsing: status line,
headers, Content-Length, chunked encoding, trailers, interim 1xx answers; this file only reacts to its
callbacks. A body framed by neither length nor chunks ends when the worker closes the connection."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from router.http1 import Pool, Response

MAX_HEAD_BYTES = 64 * 1024  # llhttp sets no limit on a head's size: this does


class ConnectionLost(ConnectionError):
    """The connection closed, broke or carried a malformed answer before the answer was complete."""


class Connection(asyncio.Protocol):
    """One connection: parses the answers to the requests it carries, one at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.open = True
        self.resp: Response | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []  # of the answer whose head is arriving
        self.head_bytes = 0  # received before the answer's head was complete
        self.interim = False  # the answer parsed now is a 1xx: the real one follows
        self.nothing_received = True
        self.paused = False
        self.requests = 0  # carried so far, this one included

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, resp: Response) -> None:
        self.resp, resp.conn = resp, self
        self.nothing_received, self.head_bytes = True, 0
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
        resp = self.resp
        if resp is None:  # an idle connection has nothing to say: drop it
            self.abort()
            return
        self.nothing_received = False
        try:
            self.parser.feed_data(data)
            if not resp.status and self.resp is resp:
                self.head_bytes += len(data)
                if self.head_bytes > MAX_HEAD_BYTES:
                    raise ConnectionLost(f"malformed HTTP answer: no complete head in {self.head_bytes} bytes")
        except httptools.HttpParserCallbackError as e:  # one of the callbacks below raised e.__context__
            self._fail(e.__context__ or e)
        except (httptools.HttpParserError, ConnectionLost) as e:
            self._fail(e)

    def eof_received(self) -> bool:
        self._lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    def _fail(self, exc: BaseException) -> None:
        self.abort()
        self._lost(exc)

    def _lost(self, exc: BaseException | None) -> None:
        self.open = False
        self.pool.discard(self)
        resp, self.resp = self.resp, None
        if resp is None:
            return
        if exc is None and resp.status and not resp.complete and not _framed(resp):
            resp._end()  # the close is the end of a body framed by neither length nor chunks
        elif self.requests > 1 and self.nothing_received and resp.error is None:
            resp._resend()  # the worker closed it while idle, as we reused it
        elif isinstance(exc, httptools.HttpParserError):
            resp.fail(ConnectionLost(f"malformed HTTP answer: {exc}"))
        else:
            why = f"{type(exc).__name__}: {exc}" if exc else "the worker closed the connection"
            resp.fail(exc if isinstance(exc, ConnectionLost) else ConnectionLost(why))

    # httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.resp is None:
            raise ConnectionLost("malformed HTTP answer: bytes after the end of the answer")
        status, headers, self.headers = self.parser.get_status_code(), self.headers, []
        if status < 200:
            self.interim = True  # 100 Continue and the like: no body, the real answer follows
            return
        self.resp._start(status, headers)

    def on_body(self, data: bytes) -> None:
        if not self.resp._feed(data) and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        resp, self.resp = self.resp, None
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        resp._end()
        if self.parser.should_keep_alive():
            self.pool.release(self)
        else:
            self.abort()


def _framed(resp: Response) -> bool:
    """Whether the answer's body has a length or chunks (else it runs until the connection closes)."""
    return resp.header("content-length") is not None or resp.header("transfer-encoding") is not None

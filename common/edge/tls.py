"""TLS on the servers' HTTP ports (engine servers under uvicorn, the bootstrap registry under aiohttp), with a
clear answer to plain HTTP.

A TLS listener on its own closes a plain-HTTP connection without a word (the handshake fails), which a user
reads as a broken server. So the listening socket speaks both at first: `TlsOrPlain` looks at a connection's
first byte; a TLS handshake record (0x16) hands the connection to asyncio's TLS protocol wrapping the
server's HTTP protocol, anything else gets a 400 JSON error naming `scheme` ("use https://") and is closed.
A connection that sends nothing within ARRIVAL_TIMEOUT_S, or does not finish its handshake in that time, is
closed, as common/edge/head_deadline.py closes one that sends no request head.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from asyncio import sslproto
from collections.abc import Callable

from common.wire.body import ARRIVAL_TIMEOUT_S

log = logging.getLogger("tandem.tls")
TLS_HANDSHAKE = 0x16  # the content type of a TLS record that opens a connection
_MESSAGE = "this port speaks HTTPS: a plain HTTP request was sent to it; use https://"
_BODY = json.dumps({"error": {"message": _MESSAGE, "type": "invalid_request_error", "code": 400, "param": "scheme"}})
PLAIN_HTTP_REFUSAL = (
    "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
    f"content-length: {len(_BODY)}\r\n\r\n{_BODY}"
).encode()


def server_context(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """The TLS context of a listening port (OSError / ssl.SSLError naming the file when it cannot load)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context


class TlsOrPlain(asyncio.Protocol):
    """One accepted connection until its first byte: then TLS to `app_protocol`, or the 400 refusal."""

    def __init__(self, app_protocol: asyncio.BaseProtocol, context: ssl.SSLContext):
        self.app_protocol, self.context = app_protocol, context
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._timer = asyncio.get_running_loop().call_later(ARRIVAL_TIMEOUT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self._timer.cancel()
        if data[0] != TLS_HANDSHAKE:
            log.debug("refused plain HTTP from %s on a TLS port", self.transport.get_extra_info("peername"))
            self.transport.write(PLAIN_HTTP_REFUSAL)
            self.transport.close()
            return
        tls = sslproto.SSLProtocol(
            asyncio.get_running_loop(),
            self.app_protocol,
            self.context,
            None,
            server_side=True,
            ssl_handshake_timeout=ARRIVAL_TIMEOUT_S,
        )
        self.transport.set_protocol(tls)
        tls.connection_made(self.transport)
        _feed(tls, data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _feed(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    """Hand bytes already read to a buffered protocol, as the transport would have."""
    view = memoryview(data)
    while view:
        buffer = protocol.get_buffer(len(view))
        n = min(len(buffer), len(view))
        buffer[:n] = view[:n]
        protocol.buffer_updated(n)
        view = view[n:]


def behind_tls(factory: Callable[..., asyncio.BaseProtocol], context: ssl.SSLContext | None) -> Callable:
    """A protocol factory (aiohttp's web.Server, a uvicorn protocol class) as it is without TLS; with it,
    each connection's protocol behind TlsOrPlain."""
    if context is None:
        return factory
    return lambda *args, **kwargs: TlsOrPlain(factory(*args, **kwargs), context)


def client_verify(ca: str | bool) -> ssl.SSLContext | bool:
    """What httpx's `verify` takes for a CA bundle path (True: the system's CAs, False: none)."""
    return ssl.create_default_context(cafile=ca) if isinstance(ca, str) else ca

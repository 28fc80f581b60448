"""The API key (`Authorization: Bearer <key>`) of every Tandem HTTP server, checked in constant time; the
engine servers' middleware is common/edge/asgi.py, the router's router/app.py."""

from __future__ import annotations

import hmac

from common.wire.errors import error_body


def unauthorized() -> dict:
    """The 401 body of a request without the right key (servers, router)."""
    return error_body(
        "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error", 401, "authorization"
    )


def bearer_matches(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())

"""One default SSL context for every httpx call the tests make.

httpx builds a fresh SSL context for every top-level call (`httpx.get`, `httpx.post`) and every Client, loading
certifi's bundle each time: about 50 ms of CPU here, against 3 ms for the request itself on 127.0.0.1. The tests
make thousands of such calls (readiness and idle polls, metrics, one request per call), nearly all of them plain
HTTP that never use the context. `share_default_ssl_context` makes httpx build the default context (verify=True,
no client certificate) once and hand out that one; a call that gives its own context (a TLS test's
`verify=ssl_context`) is unchanged. An SSLContext may be shared between connections and threads, and httpx does
not change it after building it."""

from __future__ import annotations

import functools
import warnings


def share_default_ssl_context() -> None:
    try:
        from httpx._transports import default as transports  # httpx's own module: may move in a later httpx

        build = transports.create_ssl_context
    except (ImportError, AttributeError):
        moved = "httpx.create_ssl_context moved: each httpx call builds its own SSL context (slower tests)"
        warnings.warn(moved, stacklevel=2)
        return
    shared = functools.cache(lambda: build(verify=True, cert=None, trust_env=True))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return shared()
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context

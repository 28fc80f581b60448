"""The router's TLS: the server context of its HTTPS listener (--ssl-certfile/--ssl-keyfile) and the client
context that verifies https:// workers (--ssl-ca-certs, else the system's CAs), shared by the request path's
pools and the aiohttp session (health checks, /v1/models, /get_server_info)."""

from __future__ import annotations

import ssl

from router.config import RouterConfig


def server_context(config: RouterConfig) -> ssl.SSLContext | None:
    """The listener's context, or None for plain HTTP; ssl.SSLError / OSError when the files do not load."""
    if not config.ssl_certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    return context


def client_context(config: RouterConfig) -> ssl.SSLContext:
    """Verifies a worker's certificate and its name (the host of its URL)."""
    return ssl.create_default_context(cafile=config.ssl_ca_certs)

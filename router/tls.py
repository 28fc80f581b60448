"""The router's TLS: the server context of its HTTPS listener (--ssl-certfile/--ssl-keyfile; the listener is
common/edge/tls.py's, which answers plain HTTP with a 400 naming `scheme`) and the client context that
verifies https:// workers (--ssl-ca-certs, else the system's CAs), shared by the request path's pools and
the aiohttp session (health checks, /v1/models, /get_server_info). A worker's certificate must name its
URL's host, or a discovered worker's discovery name (router/discovery.py)."""

from __future__ import annotations

import ssl

from common.edge.tls import server_context
from router.config import RouterConfig


def listener_context(config: RouterConfig) -> ssl.SSLContext | None:
    """The listener's context, or None for plain HTTP; ssl.SSLError / OSError when the files do not load."""
    return server_context(config.ssl_certfile, config.ssl_keyfile) if config.ssl_certfile else None


def client_context(config: RouterConfig) -> ssl.SSLContext:
    """Verifies a worker's certificate and its name."""
    return ssl.create_default_context(cafile=config.ssl_ca_certs)

"""`tandem router --prefill URL [BOOTSTRAP_PORT] ... --decode URL ... --policy P --port 8000`
(the same shape as sglang-router's PD mode), or `--prefill-discovery HOST:PORT --decode-discovery
HOST:PORT` to find the workers by DNS (router/discovery.py). Every flag is also a `TANDEM_ROUTER_*` environment
variable (see router/config.py); a flag given on the command line wins."""

from __future__ import annotations

import argparse
import logging
import ssl
from typing import Any

from pydantic import ValidationError

from common.wire.addresses import split_host_port
from common.wire.user_error import UserError, config_error
from router.config import SECRET_FIELDS, PrefillSpec, RouterConfig
from tandem.flags import FlagParser, add_log_level_flag, add_model_flags, log_to_stderr
from tandem.ports import require_free_ports


def parse_prefill_args(groups: list[list[str]]) -> list[PrefillSpec]:
    """`--prefill URL [BOOTSTRAP]` groups -> specs."""
    specs = []
    for g in groups:
        if not 1 <= len(g) <= 2:
            raise UserError(f"--prefill {' '.join(g)}: give URL [BOOTSTRAP_PORT | BOOTSTRAP_HOST:PORT | none]")
        try:
            host, port = parse_bootstrap(g[1] if len(g) == 2 else None)
        except ValueError as e:
            raise UserError(f"--prefill {' '.join(g)}: the bootstrap {e}; give a port, HOST:PORT or none") from None
        specs.append(PrefillSpec(url=g[0].rstrip("/"), bootstrap_port=port, bootstrap_host=host))
    return specs


def parse_bootstrap(arg: str | None) -> tuple[str | None, int | None]:
    """The port of the prefill's own registry (default 8998), `none`, or HOST:PORT of the standalone
    registry the prefill registered with -> (host or None for the prefill's own, port)."""
    if arg is None:
        return None, 8998
    if arg.lower() == "none":
        return None, None
    if ":" in arg:
        return split_host_port(arg)
    if not arg.isdigit():
        raise ValueError(f"{arg!r} is not a port")
    return None, int(arg)


def router_parser() -> argparse.ArgumentParser:
    # flags not given stay absent (SUPPRESS), so the TANDEM_ROUTER_* environment can fill them
    p = FlagParser(prog="tandem router", argument_default=argparse.SUPPRESS)
    p.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT | BOOTSTRAP_HOST:PORT | none]")
    p.add_argument("--decode", action="append", metavar="URL")
    add_model_flags(p, RouterConfig, skip=frozenset({"prefill", "decode"}), command="router")
    add_log_level_flag(p)
    return p


def config_from_args(argv: list[str]) -> RouterConfig:
    """The router's config from flags, then the environment, then the defaults."""
    given: dict[str, Any] = vars(router_parser().parse_args(argv))
    if "prefill" in given:
        given["prefill"] = parse_prefill_args(given["prefill"])
    if "decode" in given:
        given["decode"] = [d.rstrip("/") for d in given["decode"]]
    return RouterConfig(**given)


def run_router_cli(argv: list[str]) -> None:
    log_to_stderr("router")
    try:
        config = config_from_args(argv)
    except ValidationError as e:
        raise config_error(e) from None
    from router.processes import shared_dir
    from router.serve import serve_router
    from router.tls import client_context, listener_context

    try:  # the files are checked at once: a bad one is one line here, not a traceback in every process
        listener_context(config)
        client_context(config)
    except (ssl.SSLError, OSError) as e:
        raise UserError(f"--ssl-certfile, --ssl-keyfile or --ssl-ca-certs do not load ({e}): give PEM files") from None

    if not shared_dir():  # the supervisor checks; its processes then share the port (SO_REUSEPORT)
        require_free_ports(config.host, {"--port": config.port})

    log = logging.getLogger("tandem.router")
    scheme = "https" if config.ssl_certfile else "http"
    shown = config.model_dump(exclude=SECRET_FIELDS)
    log.info("router on %s://%s:%d, config %s", scheme, config.host, config.port, shown)
    serve_router(config, argv)

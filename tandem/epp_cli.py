"""`tandem epp --grpc-port 9002 (--worker URL ... | --prefill URL [BOOTSTRAP_PORT] --decode URL ...) --policy P`: the
Gateway API inference extension's endpoint picker (router/epp/), and `tandem sidecar --decode URL --port P`, the
pair sidecar on a decode pod. Every `tandem epp` flag is also a `TANDEM_EPP_*` environment variable."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pydantic import ValidationError

from common.wire.user_error import config_error
from router.epp.config import EppConfig
from tandem.flags import FlagParser, add_log_level_flag, add_model_flags, log_to_stderr
from tandem.ports import require_free_ports
from tandem.router_cli import parse_prefill_args


def epp_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="tandem epp", argument_default=argparse.SUPPRESS)
    p.add_argument("--worker", action="append", metavar="URL", help="a monolithic server (repeat for each)")
    p.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT | BOOTSTRAP_HOST:PORT | none]")
    p.add_argument("--decode", action="append", metavar="URL", help="a decode pod's pair sidecar (tandem sidecar)")
    add_model_flags(p, EppConfig, skip=frozenset({"worker", "prefill", "decode"}))
    add_log_level_flag(p)
    return p


def run_epp_cli(argv: list[str]) -> None:
    log_to_stderr("epp")
    given: dict[str, Any] = vars(epp_parser().parse_args(argv))
    if "prefill" in given:
        given["prefill"] = parse_prefill_args(given["prefill"])
    for key in ("worker", "decode"):
        if key in given:
            given[key] = [u.rstrip("/") for u in given[key]]
    try:
        config = EppConfig(**given)
    except ValidationError as e:
        raise config_error(e) from None
    require_free_ports(config.host, {"--grpc-port": config.grpc_port, "--port": config.port})
    from router.epp.serve import serve_epp

    logging.getLogger("tandem.epp").info(
        "endpoint picker on gRPC %s:%d, config %s",
        config.host,
        config.grpc_port,
        config.model_dump(exclude={"worker_api_key"}),
    )
    serve_epp(config)


def run_sidecar_cli(argv: list[str]) -> None:
    log_to_stderr("sidecar")
    from router.config import RouterConfig

    p = FlagParser(prog="tandem sidecar")
    p.add_argument("--decode", required=True, metavar="URL", help="this pod's decode server")
    p.add_argument("--port", type=int, default=8000, help="the port the gateway sends this pod's requests to")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--request-timeout-s", type=float, default=1800.0)
    p.add_argument("--worker-api-key", default=None, help="the key sent to the decode and the prefills")
    add_log_level_flag(p)
    ns = p.parse_args(argv)
    try:
        config = RouterConfig(
            decode=[ns.decode.rstrip("/")],
            port=ns.port,
            host=ns.host,
            request_timeout_s=ns.request_timeout_s,
            worker_api_key=ns.worker_api_key,
            migration_limit=0,  # the gateway placed it on this pod: it stays here
            health_check_interval_s=1.0,
        )
    except ValidationError as e:
        raise config_error(e) from None
    require_free_ports(config.host, {"--port": config.port})
    from router.epp.sidecar import serve_sidecar

    serve_sidecar(config)

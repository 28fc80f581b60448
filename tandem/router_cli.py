"""`tandem router --prefill URL [BOOTSTRAP_PORT] ... --decode URL ... --policy P --port 8000`
(the same shape as sglang-router's PD mode)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn
from pydantic import ValidationError

from router.config import PrefillSpec, RouterConfig


def parse_prefill_args(groups: list[list[str]]) -> list[PrefillSpec]:
    """`--prefill URL [PORT|none]` groups -> specs; the bootstrap port defaults to 8998."""
    specs = []
    for g in groups:
        if not 1 <= len(g) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {g}")
        port = 8998 if len(g) == 1 else (None if g[1].lower() == "none" else int(g[1]))
        specs.append(PrefillSpec(url=g[0].rstrip("/"), bootstrap_port=port))
    return specs


def run_router_cli(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="tandem router")
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar="URL [BOOTSTRAP_PORT]")
    p.add_argument("--decode", action="append", default=[], metavar="URL")
    p.add_argument("--policy", choices=["random", "round_robin", "power_of_two", "cache_aware"], default=os.environ.get("TANDEM_ROUTER_POLICY", "cache_aware"))
    p.add_argument("--host", default=os.environ.get("TANDEM_ROUTER_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("TANDEM_ROUTER_PORT", "8000")))
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--health-check-interval-s", type=float, default=5.0)
    p.add_argument("--request-timeout-s", type=float, default=1800.0)
    ns = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("TANDEM_LOG_LEVEL", "INFO"), format="%(asctime)s [router] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        config = RouterConfig(prefill=parse_prefill_args(ns.prefill), decode=[d.rstrip("/") for d in ns.decode], policy=ns.policy,
                              host=ns.host, port=ns.port, api_key=ns.api_key, health_check_interval_s=ns.health_check_interval_s,
                              request_timeout_s=ns.request_timeout_s)
    except (ValidationError, ValueError) as e:
        sys.exit(f"tandem router: {e}")
    from router.app import create_router_app

    log = logging.getLogger("tandem.router")
    log.info("router on http://%s:%d, policy %s, prefill %s, decode %s", config.host, config.port, config.policy,
             [(s.url, s.bootstrap_port) for s in config.prefill], config.decode)
    uvicorn.run(create_router_app(config), host=config.host, port=config.port, log_level="warning")

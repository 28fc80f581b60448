"""`tandem planner --router URL --mode throughput|latency|sla ...`: decides the P:D split of a router's servers and
flips them (or scales their Deployments) (planner/). Every flag is also a `TANDEM_PLANNER_*` environment variable."""

from __future__ import annotations

import argparse
import asyncio

from pydantic import ValidationError

from common.wire.user_error import config_error
from planner.config import PlannerConfig
from tandem.flags import FlagParser, add_log_level_flag, add_model_flags, log_to_stderr
from tandem.ports import require_free_ports


def planner_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="tandem planner", argument_default=argparse.SUPPRESS)
    add_model_flags(p, PlannerConfig)
    add_log_level_flag(p)
    return p


def run_planner_cli(argv: list[str]) -> None:
    log_to_stderr("planner")
    try:
        config = PlannerConfig(**vars(planner_parser().parse_args(argv)))
    except ValidationError as e:
        raise config_error(e) from None
    if config.port:
        require_free_ports(config.host, {"--port": config.port})
    from planner.app import serve_planner

    asyncio.run(serve_planner(config))

"""Every other spelling a flag of `tandem serve` or `tandem router` is accepted under, in one table.

SGLang's spellings (sglang.launch_server's server_args.py, sgl-router's launch_router) where SGLang names
the same setting differently, so that an SGLang launch line of a feature Tandem has starts Tandem
unchanged, and Tandem's own earlier spellings, so that nothing a user types changes meaning. Each is an
argparse option string of the flag itself (the same value, the same field), shown beside it in `--help`.
A row without a field is an SGLang switch for what Tandem always does: accepted, it changes nothing.
tests/unit/test_sglang_flags.py parses an SGLang launch line per feature against Tandem's own spelling.
"""

from __future__ import annotations

from typing import NamedTuple


class Spelling(NamedTuple):
    command: str  # "serve" or "router"
    field: str | None  # of ServerConfig (serve) or RouterConfig (router); None: a switch Tandem always honours
    flag: str
    whose: str  # "SGLang's", "sgl-router's" or "Tandem's old"
    why: str = ""  # a switch's: why it changes nothing


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("serve", "model", "--model-path", "SGLang's"),
    Spelling("serve", "disaggregation_mode", "--disagg-mode", "Tandem's old"),
    Spelling("serve", "transfer_backend", "--disaggregation-transfer-backend", "SGLang's"),
    Spelling("serve", "bootstrap_port", "--disaggregation-bootstrap-port", "SGLang's"),
    Spelling("serve", "transfer_device", "--disaggregation-ib-device", "SGLang's"),
    Spelling("serve", "watchdog_timeout_s", "--watchdog-timeout", "SGLang's"),
    Spelling("serve", "seed", "--random-seed", "SGLang's"),
    Spelling("serve", "tp_size", "--tp", "SGLang's"),
    Spelling("serve", "tp_size", "--tensor-parallel-size", "SGLang's"),
    Spelling("serve", "dp_size", "--dp", "SGLang's"),
    Spelling("serve", "dp_size", "--data-parallel-size", "SGLang's"),
    Spelling("serve", "ep_size", "--ep", "SGLang's"),
    Spelling("serve", "ep_size", "--expert-parallel-size", "SGLang's"),
    Spelling("router", "request_timeout_s", "--request-timeout-secs", "sgl-router's"),
    Spelling("router", "health_check_interval_s", "--health-check-interval-secs", "sgl-router's"),
    Spelling("router", "health_check_timeout_s", "--health-check-timeout-secs", "sgl-router's"),
    Spelling("router", "drain_timeout_s", "--shutdown-grace-period-secs", "sgl-router's"),
    Spelling("router", "max_request_bytes", "--max-payload-size", "sgl-router's"),
    Spelling("router", "pd_role_switch_timeout_s", "--role-switch-timeout-s", "Tandem's old"),
    Spelling("serve", None, "--enable-metrics", "SGLang's", "SGLang's switch for /metrics: Tandem always serves it"),
    Spelling(
        "serve", None, "--trust-remote-code", "SGLang's", "Tandem runs only its own model code, never a checkpoint's"
    ),
    Spelling(
        "router", None, "--pd-disaggregation", "sgl-router's", "sgl-router's PD mode: the Tandem router is always PD"
    ),
)


def spellings_of(command: str) -> dict[str | None, list[Spelling]]:
    """Field -> its other spellings, for one command (None -> the switches Tandem always honours)."""
    out: dict[str | None, list[Spelling]] = {}
    for s in SPELLINGS:
        if s.command == command:
            out.setdefault(s.field, []).append(s)
    return out

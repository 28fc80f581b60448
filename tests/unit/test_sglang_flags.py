"""SGLang's launch lines start Tandem unchanged (tandem/spellings.py): for each feature Tandem has, an SGLang
line (sglang.launch_server, sgl-router's launch_router) parses to the same config as Tandem's own spelling;
Tandem's old spellings, flags and environment variables, keep their meaning; `--help` shows every spelling."""

from __future__ import annotations

import shlex

import pytest

from common.wire.user_error import UserError
from tandem.cli import build_parser
from tandem.router_cli import config_from_args, router_parser
from tandem.server import server_config
from tandem.spellings import SPELLINGS

# feature -> (SGLang's launch line, Tandem's); both after `tandem serve`
SERVER_LINES = {
    "monolithic": (
        "--model-path builtin --host 0.0.0.0 --port 30001 --random-seed 7 --watchdog-timeout 120 "
        "--enable-metrics --trust-remote-code",
        "--model builtin --host 0.0.0.0 --port 30001 --seed 7 --watchdog-timeout-s 120",
    ),
    "pd prefill": (
        "--model-path builtin --disaggregation-mode prefill --disaggregation-transfer-backend nixl "
        "--disaggregation-bootstrap-port 9001 --disaggregation-ib-device mlx5_0",
        "--model builtin --disaggregation-mode prefill --transfer-backend nixl --bootstrap-port 9001 "
        "--transfer-device mlx5_0",
    ),
    "pd decode": (
        "--model-path builtin --disaggregation-mode decode --disaggregation-transfer-backend mooncake",
        "--model builtin --disaggregation-mode decode --transfer-backend mooncake",
    ),
    "tp across nodes": (
        "--model-path builtin --tp 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000 --dist-timeout 60",
        "--model builtin --tp-size 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000 --dist-timeout 60",
    ),
    "tp, long spelling": ("--tensor-parallel-size 2", "--tp-size 2"),
    "dp attention and ep": (
        "--tp 2 --dp 2 --ep 2 --enable-dp-attention",
        "--tp-size 2 --dp-size 2 --ep-size 2 --enable-dp-attention",
    ),
    "dp and ep, long spellings": (
        "--tp 2 --data-parallel-size 2 --expert-parallel-size 2 --enable-dp-attention",
        "--tp-size 2 --dp-size 2 --ep-size 2 --enable-dp-attention",
    ),
    "tandem's old mode flag": ("--disagg-mode decode", "--disaggregation-mode decode"),
}
ROUTER_LINES = {
    "pd router": (
        "--pd-disaggregation --prefill http://p0:30000 8998 --decode http://d0:30000 --host 0.0.0.0 --port 8001 "
        "--policy round_robin --request-timeout-secs 600 --health-check-interval-secs 30 "
        "--health-check-timeout-secs 5 --shutdown-grace-period-secs 10 --max-payload-size 1048576",
        "--prefill http://p0:30000 8998 --decode http://d0:30000 --host 0.0.0.0 --port 8001 --policy round_robin "
        "--request-timeout-s 600 --health-check-interval-s 30 --health-check-timeout-s 5 --drain-timeout-s 10 "
        "--max-request-bytes 1048576",
    ),
    "tandem's old role-switch flag": ("--role-switch-timeout-s 12", "--pd-role-switch-timeout-s 12"),
}


def serve_config(line: str):
    return server_config(build_parser().parse_args(["serve", *shlex.split(line)]))


@pytest.mark.parametrize("feature", list(SERVER_LINES))
def test_an_sglang_server_line_gives_the_config_of_tandems_spelling(feature):
    sglang, tandem = SERVER_LINES[feature]
    got, want = serve_config(sglang), serve_config(tandem)
    assert got == want
    assert got != serve_config("")  # the line set something


@pytest.mark.parametrize("feature", list(ROUTER_LINES))
def test_an_sgl_router_line_gives_the_config_of_tandems_spelling(feature):
    sglang, tandem = ROUTER_LINES[feature]
    got, want = config_from_args(shlex.split(sglang)), config_from_args(shlex.split(tandem))
    assert got == want
    assert got != config_from_args([])


def test_each_spelling_is_tested_here_and_shown_in_help():
    lines = " ".join(f"{a} {b}" for a, b in [*SERVER_LINES.values(), *ROUTER_LINES.values()]).split()
    helps = {"serve": build_parser()._subparsers._group_actions[0].choices["serve"].format_help()}
    helps["router"] = router_parser().format_help()
    for s in SPELLINGS:  # a spelling of a field, or a switch Tandem always honours
        assert s.flag in lines, s
        assert s.flag in helps[s.command], s


def test_old_environment_names_keep_their_meaning(monkeypatch):
    monkeypatch.setenv("TANDEM_DISAGG_MODE", "decode")
    monkeypatch.setenv("TANDEM_ROUTER_ROLE_SWITCH_TIMEOUT_S", "12")
    assert serve_config("").disaggregation_mode == "decode"
    assert config_from_args([]).pd_role_switch_timeout_s == 12
    monkeypatch.setenv("TANDEM_DISAGGREGATION_MODE", "prefill")
    monkeypatch.setenv("TANDEM_ROUTER_PD_ROLE_SWITCH_TIMEOUT_S", "13")
    assert serve_config("").disaggregation_mode == "prefill"  # the new name first
    assert config_from_args([]).pd_role_switch_timeout_s == 13
    assert serve_config("--disagg-mode null").disaggregation_mode == "null"  # a flag wins over the environment


@pytest.mark.parametrize("typed", ["--disaggregation-mode", "--disagg-mode"])
def test_a_bad_value_is_named_by_the_spelling_the_user_typed(typed, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", typed, "both"])
    assert capsys.readouterr().err.startswith(f"tandem serve: argument {typed}: invalid choice: 'both'")


def test_a_bad_value_under_an_old_environment_name_is_named_by_its_flag(monkeypatch):
    monkeypatch.setenv("TANDEM_DISAGG_MODE", "both")
    with pytest.raises(UserError, match=r"^--disaggregation-mode both: Input should be 'null', 'prefill' or 'decode'$"):
        serve_config("")

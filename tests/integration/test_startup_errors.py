"""Start-up mistakes as a user makes them, through the real CLI (`python -m tandem ...` subprocesses): each
ends with exit code 1 (2 for a command line argparse cannot read) and one line on stderr naming the flag
or path, before any model loads; `--log-level debug` adds the traceback, and a bug always shows one.

Every command starts at once (module fixture) and each test reads its result: they fail in about a second."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.model.locate import SUPPORTED_ARCHITECTURES
from tests.conftest import ROOT

BUG = "import tandem.server as s; s.check_before_loading = lambda config: 1 / 0; from tandem.cli import main; main()"


def cases(busy: int, gpt2: Path) -> dict[str, tuple[list[str], int, str]]:
    """name -> (arguments of `python`, exit code, the whole stderr line)."""
    tandem = ["-m", "tandem"]
    model = "give a Hugging Face model directory (with config.json), a .gguf file or 'builtin'"
    in_use = f"another process listens on 127.0.0.1:{busy}; stop it or choose another port"
    return {
        "serve-missing-model": (
            [*tandem, "serve", "--model", "/nonexistent/model"],
            1,
            f"tandem serve: --model /nonexistent/model: not found; {model}",
        ),
        "serve-unsupported-architecture": (
            [*tandem, "serve", "--model", str(gpt2)],
            1,
            f"tandem serve: --model {gpt2}: architecture GPT2LMHeadModel is not supported; serve a model of one "
            f"of {', '.join(sorted(SUPPORTED_ARCHITECTURES))}",
        ),
        "serve-contradicting-flags": (
            [*tandem, "serve", "--page-size", "16", "--chunked-prefill-size", "100"],
            1,
            "tandem serve: --chunked-prefill-size 100 is not a multiple of --page-size 16: give a multiple, or 0 "
            "to turn chunked prefill off",
        ),
        "serve-deepep": (
            [*tandem, "serve", "--moe-a2a-backend", "deepep"],
            1,
            "tandem serve: --moe-a2a-backend deepep: Tandem does not ship DeepEP's kernels; use --moe-a2a-backend "
            "none (torch.distributed all-to-all: NCCL on CUDA, gloo on the CPU)",
        ),
        "serve-value-out-of-range": (
            [*tandem, "serve", "--page-size", "0"],
            1,
            "tandem serve: --page-size 0: Input should be greater than or equal to 1",
        ),
        "serve-unknown-choice": (
            [*tandem, "serve", "--disaggregation-mode", "both"],
            2,
            "tandem serve: argument --disaggregation-mode: invalid choice: 'both' (choose from 'null', 'prefill', "
            "'decode') (see `tandem serve --help`)",
        ),
        "serve-port-in-use": ([*tandem, "serve", "--port", str(busy)], 1, f"tandem serve: --port {busy}: {in_use}"),
        "prefill-bootstrap-port-in-use": (
            [*tandem, "serve", "--disaggregation-mode", "prefill", "--bootstrap-port", str(busy)],
            1,
            f"tandem serve: --bootstrap-port {busy}: {in_use}",
        ),
        "serve-store-without-host-tier": (
            [*tandem, "serve", "--hicache-storage-backend", "file"],
            1,
            "tandem serve: --hicache-storage-backend file is the tier behind the host tier: add "
            "--enable-hierarchical-cache",
        ),
        "serve-store-extra-config-field-missing": (
            [*tandem, "serve", "--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"],
            1,
            "tandem serve: --hicache-storage-backend-extra-config: master_server_address: Field required "
            "(--hicache-storage-backend mooncake)",
        ),
        "kv-store-port-in-use": (
            [*tandem, "kv-store", "--port", str(busy)],
            1,
            f"tandem kv-store: --port {busy}: {in_use}",
        ),
        "up-missing-model": (
            [*tandem, "up", "--model", "/nonexistent/model"],
            1,
            f"tandem up: --model /nonexistent/model: not found; {model}",
        ),
        "up-flag-it-sets-itself": (
            [*tandem, "up", "--", "--port", "9"],
            1,
            "tandem up: --port after --: tandem up sets it for every server; give `tandem up --port` instead",
        ),
        "up-kv-policy-without-a-router": (
            [*tandem, "up", "--mode", "monolithic", "--decode-policy", "kv_aware"],
            1,
            "tandem up: --decode-policy kv_aware: the router's policy needs --mode pd (a monolithic server has no "
            "router)",
        ),
        "up-port-in-use": ([*tandem, "up", "--port", str(busy)], 1, f"tandem up: --port {busy}: {in_use}"),
        "router-port-in-use": ([*tandem, "router", "--port", str(busy)], 1, f"tandem router: --port {busy}: {in_use}"),
        "router-bad-bootstrap": (
            [*tandem, "router", "--prefill", "http://127.0.0.1:1", "eight"],
            1,
            "tandem router: --prefill http://127.0.0.1:1 eight: the bootstrap 'eight' is not a port; give a port, "
            "HOST:PORT or none",
        ),
        "bootstrap-port-in-use": (
            [*tandem, "bootstrap", "--port", str(busy)],
            1,
            f"tandem bootstrap: --port {busy}: {in_use}",
        ),
    }


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt2")
    (path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return path


@pytest.fixture(scope="module")
def results(busy_port, gpt2_dir) -> dict[str, subprocess.CompletedProcess]:
    """Every case's command, run side by side."""
    commands = {name: args for name, (args, _, _) in cases(busy_port, gpt2_dir).items()}
    commands["debug"] = ["-m", "tandem", "serve", "--model", "/nonexistent/model", "--log-level", "debug"]
    commands["bug"] = ["-c", BUG, "serve"]
    procs = {
        name: subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, args in commands.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout.decode(), stderr.decode())
    return out


@pytest.mark.parametrize("name", list(cases(0, Path())))
def test_a_user_error_is_one_line_naming_the_flag_and_a_nonzero_exit(results, busy_port, gpt2_dir, name):
    _, code, line = cases(busy_port, gpt2_dir)[name]
    done = results[name]
    assert (done.returncode, done.stderr) == (code, line + "\n"), done.stderr[-3000:]


def test_debug_adds_the_traceback_and_a_bug_always_shows_one(results):
    debug, bug = results["debug"], results["bug"]
    assert debug.returncode == 1 and debug.stderr.startswith("Traceback (most recent call last):")
    assert debug.stderr.splitlines()[-1].startswith("tandem serve: --model /nonexistent/model: not found;")
    assert bug.returncode == 1 and "Traceback (most recent call last):" in bug.stderr
    assert bug.stderr.splitlines()[-1] == "ZeroDivisionError: division by zero"

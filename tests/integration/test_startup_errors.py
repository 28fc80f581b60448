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


def broken_models(root: Path) -> dict[str, tuple[list[str], str]]:
    """Checkpoints a loader cannot read, as a user meets them: name -> (`serve` arguments, the last line)."""
    from safetensors.torch import load_file, save_file

    from common.quant.int4_scheme import SUPPORTED_INT4
    from tests.integration.fp8_models import to_fp8_block
    from tests.integration.tiny_model import save_tiny_llama

    def tiny(name: str) -> Path:
        return save_tiny_llama(root / name)

    awq = tiny("awq")
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 3, "group_size": 128}
    (awq / "config.json").write_text(json.dumps(config))
    no_tokenizer = tiny("no-tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tokenizer / f).unlink(missing_ok=True)
    no_shard = tiny("no-shard")
    (no_shard / "model.safetensors").rename(no_shard / "model-00001-of-00002.safetensors")
    weight_map = {"model.norm.weight": "model-00002-of-00002.safetensors"}
    (no_shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    truncated = tiny("truncated")
    shard = truncated / "model.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    fp8 = to_fp8_block(tiny("fp8-src"), root / "fp8", (32, 32))
    state = load_file(fp8 / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(state, fp8 / "model.safetensors", metadata={"format": "pt"})
    odd_gguf = write_gguf(root / "jamba.gguf", "jamba")
    scale = "model.layers.1.mlp.up_proj.weight"
    return {
        "unsupported-quantization": (
            ["--model", str(awq)],
            f"tandem serve: --model {awq}: quantization_config.bits 3 is not supported; Tandem reads {SUPPORTED_INT4}",
        ),
        "quantization-flag-on-unquantized": (
            ["--model", str(truncated), "--quantization", "fp8"],
            f"tandem serve: --quantization fp8: --model {truncated} has unquantized weights (no quantization_config "
            "in its config.json) and Tandem quantizes none at load; drop the flag or give a quantized checkpoint",
        ),
        "fp8-scale-missing": (
            ["--model", str(fp8)],
            f"tandem serve: {scale} is float8 but {scale}_scale_inv is missing; an FP8 weight needs its scale",
        ),
        "tokenizer-missing": (
            ["--model", str(no_tokenizer)],
            f"tandem serve: --model {no_tokenizer}: no tokenizer (tokenizer.json, tokenizer.model, vocab.json); "
            "copy the checkpoint's tokenizer files into it",
        ),
        "shard-missing": (
            ["--model", str(no_shard)],
            f"tandem serve: --model {no_shard}: shard model-00002-of-00002.safetensors listed in "
            "model.safetensors.index.json is missing; download it again",
        ),
        "truncated-safetensors": (
            ["--model", str(truncated)],
            f"tandem serve: {shard}: truncated ({size - 100} bytes of {size}; an interrupted download?)",
        ),
        "unsupported-gguf": (
            ["--model", str(odd_gguf)],
            f"tandem serve: --model {odd_gguf}: this GGUF cannot be read: GGUF model with architecture jamba is not "
            "supported yet; serve a GGUF of a Llama-family model",
        ),
    }


def write_gguf(path: Path, architecture: str) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def loading_results(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Each broken checkpoint served at once; name -> (exit code, last line, expected line)."""
    from tests.conftest import ServerProcess, free_port

    root = tmp_path_factory.mktemp("broken")
    env = {"TANDEM_CACHE_DIR": str(root / "cache")}  # the GGUF's conversion, never the user's cache
    started = {}
    for name, (args, line) in broken_models(root).items():
        port = free_port()
        started[name] = (ServerProcess(["serve", "--port", str(port), *args], port, name=name, env=env), line)
    return {name: (*server.run_to_exit(), line) for name, (server, line) in started.items()}


LOADING_CASES = [
    "unsupported-quantization",
    "quantization-flag-on-unquantized",
    "fp8-scale-missing",
    "tokenizer-missing",
    "shard-missing",
    "truncated-safetensors",
    "unsupported-gguf",
]


@pytest.mark.parametrize("name", LOADING_CASES)
def test_a_checkpoint_the_loader_cannot_read_is_one_line_naming_it(loading_results, name):
    code, last, line = loading_results[name]
    assert (code, last) == (1, line)


def test_ctrl_c_while_tandem_up_starts_stops_every_process_without_a_traceback(builtin_model_dir):
    """A terminal's Ctrl-C reaches the whole foreground group: `tandem up` alone must see it (its children
    run in their own groups) and stop them, none printing a KeyboardInterrupt traceback mid-import."""
    import os
    import signal
    import time

    from tests.ports import free_port

    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem", "up", "--mode", "pd", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
    )
    lines = []
    while not any(line.startswith("[up] starting") for line in lines):
        lines.append(up.stdout.readline())
        assert lines[-1], "".join(lines)
    time.sleep(1.0)  # the first children are importing
    os.killpg(up.pid, signal.SIGINT)
    rest, _ = up.communicate(timeout=60)
    out = "".join(lines) + rest
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.rstrip().endswith("[up] stopped") and up.returncode == 0, out
    left = subprocess.run(["pgrep", "-f", f"tandem.* {port}"], capture_output=True, text=True).stdout
    assert not left, left

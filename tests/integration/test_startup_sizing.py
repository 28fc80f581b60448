"""Start-up sizing as a user meets it: the KV pool in tokens and GiB in the log, a context length the
pool caps is stated (and reported by the API), one it cannot hold stops the server with the flags to change;
the warm-up runs (and says how long) before the server is ready; an attention backend that cannot run
stops it naming the flags."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx

from tests.conftest import ROOT, ServerProcess, free_port, start_server


def test_a_context_length_the_pool_cannot_hold_stops_start_up_naming_the_flags(tiny_model_dir):
    port = free_port()
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), "--context-length", "2000"]
    code, last = ServerProcess([*args, "--max-total-tokens", "1024"], port, name="sizing-refused").run_to_exit()
    assert code == 1
    assert last == (
        "tandem serve: --context-length 2000 does not fit the KV pool of 1024 tokens (at most 1008): lower "
        "--context-length, or give the pool more room with --max-total-tokens (CPU) or --mem-fraction-static (CUDA)"
    )


def test_a_pool_smaller_than_the_model_context_caps_it_and_says_so(tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--max-total-tokens", "1024", name="sizing").wait_ready()
    try:
        log = server.log_path.read_text()
        pool = "KV pool: 1024 tokens (64 pages x 16), 0.5 MiB, from --max-total-tokens"  # 65 pages x 16 x 512 bytes
        assert f"attention TorchAttention; {pool}\n" in log
        assert "context length capped to 1008 tokens by the KV pool of 1024 tokens (the model allows 2048)" in log
        warm = re.search(r"warm-up: kernels built or loaded in [0-9.]+ s \(33-token prefill, decode step", log)
        assert warm is not None and warm.start() < log.index("ready in")
        info = server.info()
        assert info["context_length"] == 1008 and info["kv_pages"]["total"] == 64
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["max_model_len"] == 1008
        r = httpx.post(
            server.url + "/generate",
            json={"input_ids": [1] * 1008, "sampling_params": {"max_new_tokens": 1}},
            timeout=30,
        )
        assert r.status_code == 400 and "context length is 1008" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_flashinfer_on_a_cpu_stops_start_up_naming_the_flags():
    args = ["serve", "--port", str(free_port()), "--attention-backend", "flashinfer"]
    out = subprocess.run([sys.executable, "-m", "tandem", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "tandem serve: --attention-backend flashinfer needs --device cuda; use --attention-backend torch on cpu"
    )

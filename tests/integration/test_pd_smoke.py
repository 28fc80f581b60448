"""The fast tier's PD round trip on each transfer backend (test_pd.py is the whole check): router ->
prefill -> Mooncake | NIXL -> decode on the tiny random Llama, greedy tokens equal to transformers'
generate, and every pool idle afterwards. The Mooncake cluster is launched with SGLang's spellings
(sglang.launch_server's and sgl-router's flags, tandem/spellings.py), the NIXL one with Tandem's."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import free_port, start_server
from tests.integration.cluster import Cluster, generate, start_cluster
from tests.integration.tiny_model import random_prompts

FLAGS = {  # one backend with chunked prefill over pages of 16, the other with single-token pages
    "mooncake": ("--page-size", "16", "--chunked-prefill-size", "64"),
    "nixl": ("--page-size", "1", "--chunked-prefill-size", "0"),
}
MODULES = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}
PROMPTS = random_prompts(3, 5, 150, seed=3)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        tokens = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
        out.append(tokens[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module", params=list(FLAGS))
def cluster(request, tiny_model_dir):
    pytest.importorskip(MODULES[request.param])
    if request.param == "mooncake":
        c = sglang_cluster(str(tiny_model_dir), FLAGS["mooncake"])
    else:
        c = start_cluster(request.param, flags=("--model", str(tiny_model_dir), *FLAGS[request.param]))
    yield c
    c.stop()


def sglang_cluster(model_dir: str, flags: tuple[str, ...]) -> Cluster:
    """A prefill, a decode and the router, each started with the launch line SGLang's docs give it."""
    common = ("--model-path", model_dir, "--random-seed", "0", "--watchdog-timeout", "240", "--enable-metrics")
    backend = ("--disaggregation-transfer-backend", "mooncake", "--trust-remote-code", *common, *flags)
    router = ("--pd-disaggregation", "--health-check-interval-secs", "1", "--request-timeout-secs", "600")
    c = Cluster(router_args=router)
    try:
        boot = ("--disaggregation-bootstrap-port", str(free_port()))
        c.prefills.append(start_server("--disaggregation-mode", "prefill", *boot, *backend, name="prefill0"))
        c.decodes.append(start_server("--disaggregation-mode", "decode", *backend, name="decode0"))
        c.spawn_router()
    except BaseException:
        c.stop()
        raise
    return c.wait_ready()


@pytest.mark.smoke
def test_greedy_tokens_through_the_router_equal_transformers(cluster, expected):
    assert max(len(p) for p in PROMPTS) > 64  # more than one prefill chunk on mooncake
    for ids, want in zip(PROMPTS, expected):
        got = generate(cluster.url, ids, NEW_TOKENS, sampling={"ignore_eos": True})
        assert got["output_ids"] == want, f"prompt of {len(ids)} tokens diverged"
    cluster.wait_idle()


@pytest.mark.smoke
def test_each_server_runs_the_config_its_launch_line_spells(cluster):
    """SGLang's spellings (mooncake) and Tandem's (nixl) set the same fields: the mode, the backend, the
    bootstrap port and the watchdog each server reports are those its line gave."""
    for server, mode in [(p, "prefill") for p in cluster.prefills] + [(d, "decode") for d in cluster.decodes]:
        config = httpx.get(server.url + "/get_server_info", timeout=30).json()["config"]
        backend = server.arg("--disaggregation-transfer-backend") or server.arg("--transfer-backend")
        assert (config["disaggregation_mode"], config["transfer_backend"]) == (mode, backend)
        if mode == "prefill":
            assert config["bootstrap_port"] == cluster.prefill_bootstrap_ports[0]
        assert config["watchdog_timeout_s"] == float(server.arg("--watchdog-timeout") or 300)

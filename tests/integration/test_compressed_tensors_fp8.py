"""llm-compressor's FP8 checkpoints (compressed-tensors `float-quantized`) served as FP8, against
transformers' compressed-tensors loader (the `compressed-tensors` package) dequantizing the same weights.

A tiny random Llama written in the exact on-disk layout (tests/integration/fp8_models.py) twice:

    per-channel weight scales, dynamic activations   monolithic TP 1, PD TP 2 (prefill and decode)
    per-tensor weight scales, static activations     monolithic TP 1

Greedy tokens equal (TP 2: a divergence only at a reported near-tie), logprobs within LOGPROB_TOL; the
start-up summary names the scheme, says the CPU's product is weight-only, and resident weight bytes stay
within 1.1x of the checkpoint's.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from tests.conftest import start_server
from tests.integration.fp8_models import dequantize_channel, to_compressed_fp8
from tests.integration.test_fp8_checkpoints import check_against, flags, summary_of
from tests.integration.test_pd_families import NEW_TOKENS, pd_generate, start_role
from tests.integration.test_tensor_parallel import generate_all
from tests.integration.tiny_model import hf_greedy, random_prompts, save_tiny_llama

SCHEMES = {"channel": False, "tensor": True}  # weight strategy -> static activations
SUMMARY = {
    "channel": "weights: compressed-tensors fp8 per-channel, dynamic activations in 14 linear layers",
    "tensor": "weights: compressed-tensors fp8 per-tensor, static activations in 14 linear layers",
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ct")
    src = save_tiny_llama(root / "src")
    return {s: to_compressed_fp8(src, root / s, s, static) for s, static in SCHEMES.items()}


@pytest.fixture(scope="module")
def servers(dirs):
    """Monolithic TP 1 of each scheme, and a TP 2 prefill and decode of the per-channel one."""
    started = {s: start_server(*flags(dirs[s], 1), name=f"mono-ct-{s}") for s in SCHEMES}
    prefill, _ = start_role("prefill", "mooncake", flags(dirs["channel"], 2), "p-ct")
    decode, _ = start_role("decode", "mooncake", flags(dirs["channel"], 2), "d-ct")
    try:
        for s in (*started.values(), prefill, decode):
            s.wait_ready(300)
        yield started, (prefill, int(prefill.arg("--bootstrap-port"))), decode
    finally:
        for s in (*started.values(), prefill, decode):
            s.stop()


def reference(model_dir):
    """transformers' compressed-tensors loader, dequantizing; its weights are the format's reading."""
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    state = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(
        hf.get_parameter(name + ".weight"), dequantize_channel(state[name + ".weight"], state[name + ".weight_scale"])
    )
    return hf


@pytest.mark.timeout(900)  # four servers (six processes) start first
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_fp8_serves_equal_to_transformers(servers, dirs, scheme):
    monolithic, prefill, decode = servers
    hf, prompts = reference(dirs[scheme]), random_prompts(3, 5, 60, seed=6)
    want = hf_greedy(hf, prompts, NEW_TOKENS)
    mono = monolithic[scheme]
    check_against(hf, prompts, want, generate_all(mono.url, prompts, NEW_TOKENS), f"{scheme} monolithic", 1)
    log = mono.log_path.read_text()
    assert SUMMARY[scheme] in log and "(weight-only:" in log
    layers, resident, checkpoint = summary_of(mono)
    assert layers == 14 and resident <= 1.1 * checkpoint
    if scheme == "channel":  # per-channel scales split with their rows at TP 2
        pd = [pd_generate(prefill, decode, ids) for ids in prompts]
        assert all(r.status_code == 200 for r in pd), [r.text for r in pd]
        check_against(hf, prompts, want, [r.json() for r in pd], "per-channel PD at TP 2", 2)
        prefill[0].wait_idle(), decode.wait_idle()
    mono.wait_idle()

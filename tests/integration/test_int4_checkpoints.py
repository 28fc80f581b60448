"""4-bit weight-only checkpoints (AWQ, GPTQ with desc_act, compressed-tensors pack-quantized) served in 4
bits, against transformers on the same dequantized weights, read by a library that is not ours where one
exists (tests/integration/int4_models.py):

    awq, group 64                monolithic TP 1   reference: compressed-tensors' AutoAWQConverter, then
                                                   transformers' compressed-tensors loader
    gptq v1, desc_act, group 32  monolithic TP 1   reference: the dequantized weights (vLLM's layout)
    pack-quantized, group 32     PD TP 2 (1P1D, Mooncake TCP)   reference: transformers' compressed-tensors loader

The layers run torch's CPU int4 kernel in bfloat16 (its scales and offsets in bfloat16 too), the reference
float32: greedy tokens equal except at a near-tie of the server's top two (gap < NEAR_TIE, reported), and
logprobs of the equal tokens within LOGPROB_TOL. The start-up summary names the scheme and resident
weight bytes stay within 1.1x of the checkpoint's.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from tests.conftest import start_server
from tests.integration.int4_models import to_awq, to_gptq, to_pack_quantized
from tests.integration.test_dp_ep import hf_logprobs
from tests.integration.test_fp8_checkpoints import flags, summary_of
from tests.integration.test_pd_families import NEW_TOKENS, pd_generate, start_role
from tests.integration.test_tensor_parallel import generate_all
from tests.integration.tiny_model import hf_greedy, random_prompts, save_tiny_llama

LOGPROB_TOL = 0.2  # bfloat16 activations, scales and offsets in the kernel against a float32 reference (measured: 0.13)
NEAR_TIE = 0.1
SUMMARY = {
    "awq": "weights: awq int4 group 64, zero points in 14 linear layers",
    "gptq": "weights: gptq int4 group 32, zero points, act-order in 14 linear layers",
    "ct": "weights: compressed-tensors pack-quantized int4 group 32, zero points in 14 linear layers",
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    """{scheme: (checkpoint served, checkpoint the reference loads)}."""
    root = tmp_path_factory.mktemp("int4")
    src = save_tiny_llama(root / "src")
    awq = to_awq(src, root / "awq", 64)
    convert_checkpoint(awq, root / "awq-ct", AutoAWQConverter.from_pretrained(awq), max_workers=1, device="cpu")
    gptq = to_gptq(src, root / "gptq", root / "gptq-plain", 32, desc_act=True)
    ct = to_pack_quantized(src, root / "ct", 32)
    return {"awq": (awq, root / "awq-ct"), "gptq": (gptq, root / "gptq-plain"), "ct": (ct, ct)}


@pytest.fixture(scope="module")
def servers(dirs):
    """Monolithic AWQ and GPTQ at TP 1, and a TP 2 prefill and decode of the pack-quantized one."""
    started = {s: start_server(*flags(dirs[s][0], 1), name=f"mono-int4-{s}") for s in ("awq", "gptq")}
    prefill, _ = start_role("prefill", "mooncake", flags(dirs["ct"][0], 2), "p-int4")
    decode, _ = start_role("decode", "mooncake", flags(dirs["ct"][0], 2), "d-int4")
    try:
        for s in (*started.values(), prefill, decode):
            s.wait_ready(300)
        yield started, (prefill, int(prefill.arg("--bootstrap-port"))), decode
    finally:
        for s in (*started.values(), prefill, decode):
            s.stop()


def reference(model_dir):
    quantized = "quantization_config" in (model_dir / "config.json").read_text()
    quantized = CompressedTensorsConfig(dequantize=True) if quantized else None
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quantized).eval()


def check_against(hf, prompts, want, got: list[dict], label: str) -> None:
    """Token for token up to a reported near-tie; logprobs of the tokens equal so far within LOGPROB_TOL."""
    worst = 0.0
    for i, (prompt, tokens, out) in enumerate(zip(prompts, want, got)):
        ids = out["output_ids"]
        same = next((j for j, (a, b) in enumerate(zip(tokens, ids)) if a != b), len(tokens))
        if same < len(tokens):
            (lp1, _, _), (lp2, _, _) = out["meta_info"]["output_top_logprobs"][same]
            print(f"{label}: prompt {i} diverges at token {same}, top-2 gap {abs(lp1 - lp2):.2e} (near-tie)")
            assert abs(lp1 - lp2) < NEAR_TIE, f"{label}: prompt {i}: {tokens} vs {ids}"
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"][:same]]
        theirs = hf_logprobs(hf, prompt, tokens[:same]) if same else []
        worst = max([worst, *(abs(a - b) for a, b in zip(ours, theirs))])
    print(f"{label}: largest logprob difference {worst:.2e}")
    assert worst < LOGPROB_TOL, label


@pytest.mark.timeout(900)  # four servers (six processes) start first
@pytest.mark.parametrize("scheme", ["awq", "gptq", "ct"])
def test_int4_serves_equal_to_transformers(servers, dirs, scheme):
    monolithic, prefill, decode = servers
    hf, prompts = reference(dirs[scheme][1]), random_prompts(3, 5, 60, seed=7)
    want = hf_greedy(hf, prompts, NEW_TOKENS)
    if scheme == "ct":
        pd = [pd_generate(prefill, decode, ids) for ids in prompts]
        assert all(r.status_code == 200 for r in pd), [r.text for r in pd]
        check_against(hf, prompts, want, [r.json() for r in pd], "pack-quantized PD at TP 2")
        shown = decode
    else:
        shown = monolithic[scheme]
        check_against(hf, prompts, want, generate_all(shown.url, prompts, NEW_TOKENS), f"{scheme} monolithic")
    assert SUMMARY[scheme] in shown.log_path.read_text(), shown.log_tail()
    layers, resident, checkpoint = summary_of(shown)
    assert layers == 14 and resident <= 1.1 * checkpoint
    for s in (*monolithic.values(), prefill[0], decode):
        s.wait_idle()

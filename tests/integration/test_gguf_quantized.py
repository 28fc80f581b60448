"""The built-in model served from its own Q4_1 GGUF kept quantized (`--quantization gguf`) against
transformers on the same dequantized weights: transformers' GGUF loader's float32 copy (the default's
weights, which tests/unit/test_quant_gguf.py checks equal the `gguf` package's dequantization and our
unpacking). The 4-bit layers run torch's int4 kernel with bfloat16 activations and bfloat16 scales, so
the reference is not bit-equal: greedy tokens equal transformers' up to a divergence only at a near-tie of
transformers' top two (below NEAR_TIE), logprobs within LOGPROB_TOL before it. Monolithic and PD (1P1D,
Mooncake), one request at a time, run the same kernels and equal each other token for token (logprobs within
BATCH_TOL; in a batch of other requests the bfloat16 rounding moves a logprob by up to ~0.03); TP 3, the
prompts in one batch, equals TP 1 up to a near-tie. A decode of the GGUF kept quantized refuses a prefill of its float32 copy, naming both.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import start_server
from tests.integration.test_dp_ep import hf_logprobs
from tests.integration.test_parity_hf import prompts as parity_prompts
from tests.integration.test_pd_families import NEW_TOKENS, pd_generate, start_role
from tests.integration.test_tensor_parallel import assert_same_tokens, generate_all
from tests.integration.tiny_model import hf_greedy

LOGPROB_TOL = 0.25  # nats: bfloat16 activations and scales in 210 layers against float32 (measured: at most 0.14)
BATCH_TOL = 1e-4  # PD against monolithic, each request alone: the same kernels on the same rows
NEAR_TIE = 0.3  # transformers' top-2 gap where a flip is the rounding's, not a wrong weight
GGUF = ("--model", "builtin", "--quantization", "gguf", "--max-total-tokens", "4096", "--chunked-prefill-size", "64")
SUMMARY = re.compile(r"weights: gguf kept quantized, (\d+) Q4_1 linear layers.* ([\d.]+) MiB resident for ([\d.]+) MiB")


@pytest.fixture(scope="module")
def servers():
    """Monolithic TP 1 and TP 3, a PD pair (prefill, bootstrap port) and decode, all kept quantized, and a
    prefill of the float32 copy."""
    mono = start_server(*GGUF, name="gguf-mono")
    tp3 = start_server(*GGUF, "--tp-size", "3", name="gguf-tp3")
    prefill, _ = start_role("prefill", "mooncake", GGUF, "gguf-p")
    decode, _ = start_role("decode", "mooncake", GGUF, "gguf-d")
    plain, _ = start_role("prefill", "mooncake", GGUF[:2] + GGUF[4:], "f32-p")
    started = [mono, tp3, prefill, decode, plain]
    try:
        for s in started:
            s.wait_ready(400)
        boot = lambda p: (p, int(p.arg("--bootstrap-port")))  # noqa: E731
        yield mono, tp3, boot(prefill), decode, boot(plain)
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def reference(builtin_model_dir):
    """The parity prompts (chat and raw, long ones prefilled in chunks), transformers' model and its tokens."""
    ids = parity_prompts(AutoTokenizer.from_pretrained(builtin_model_dir))[::2]
    hf = AutoModelForCausalLM.from_pretrained(builtin_model_dir, dtype=torch.float32).eval()
    return ids, hf, hf_greedy(hf, ids, NEW_TOKENS)


def check_against_transformers(hf, prompts, want, got: list[dict], label: str) -> None:
    for i, (prompt, tokens, out) in enumerate(zip(prompts, want, got)):
        ids = out["output_ids"]
        at = next((j for j, (a, b) in enumerate(zip(tokens, ids)) if a != b), len(tokens))
        theirs = hf_logprobs(hf, prompt, ids)
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        worst = max(abs(a - b) for a, b in zip(ours[: at + 1], theirs[: at + 1]))
        print(f"{label}: prompt {i}: equal for {at} of {len(tokens)} tokens, logprobs within {worst:.3f}")
        assert worst < LOGPROB_TOL, f"{label}: prompt {i}: logprobs {worst:.3f} from transformers'"
        if at < len(tokens):
            top2 = torch.log_softmax(hf(torch.tensor([prompt + tokens[:at]])).logits[0, -1], -1).topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, f"{label}: prompt {i} diverges at token {at}: {tokens} vs {ids} (gap {gap:.3f})"


@pytest.mark.timeout(900)  # five servers of the built-in model (seven processes) start first
@torch.no_grad()
def test_gguf_kept_quantized_equals_transformers_monolithic_pd_and_tp3(servers, reference):
    mono, tp3, prefill, decode, _ = servers
    prompts, hf, want = reference
    got = [generate_all(mono.url, [ids], NEW_TOKENS)[0] for ids in prompts]  # one at a time, as PD below
    check_against_transformers(hf, prompts, want, got, "gguf monolithic")
    pd = [pd_generate(prefill, decode, ids) for ids in prompts]
    assert all(r.status_code == 200 for r in pd), [r.text for r in pd]
    for m, p in zip(got, pd):
        assert p.json()["output_ids"] == m["output_ids"]
        pairs = zip(p.json()["meta_info"]["output_token_logprobs"], m["meta_info"]["output_token_logprobs"])
        assert max(abs(a[0] - b[0]) for a, b in pairs) < BATCH_TOL
    assert_same_tokens([g["output_ids"] for g in got], generate_all(tp3.url, prompts, NEW_TOKENS), "gguf TP 3")
    found = SUMMARY.search(mono.log_path.read_text())
    assert found, mono.log_tail()
    layers, resident, file_mib = int(found[1]), float(found[2]), float(found[3])
    assert layers == 210 and resident < 2 * file_mib  # 4-bit layers, the Q8_0 embedding dequantized (float32)
    whole = mono.info()["tp"]["ranks"][0]["weight_bytes"]
    assert resident * 2**20 == pytest.approx(whole, rel=0.01)
    for s in (mono, tp3, prefill[0], decode):
        s.wait_idle()


def test_a_decode_kept_quantized_refuses_a_prefill_of_the_float32_copy(servers, reference):
    _, _, _, decode, plain = servers
    r = pd_generate(plain, decode, reference[0][0])
    assert r.status_code == 502, r.text
    assert "weights: decode has 'gguf Q4_1 kept quantized', prefill has 'none'" in r.json()["error"]["message"]
    decode.wait_idle(), plain[0].wait_idle()

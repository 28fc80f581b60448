"""DeepSeek's FP8 block checkpoints served as FP8, against transformers on the same dequantized weights.

Two tiny random models rewritten in the exact on-disk layout (tests/integration/fp8_models.py): a Llama in
32x32 blocks (several blocks per weight; at TP 2 the k/v rows split inside a block) and a DeepSeek-V3 in
8x8 blocks (MLA, routed and shared experts). The reference is transformers' FineGrainedFP8 loader, which on
the CPU dequantizes to the checkpoint's meaning (checked here against the format's own reading). Greedy
tokens equal (TP 2: a divergence only at a reported near-tie), logprobs within LOGPROB_TOL, for

    Llama      monolithic TP 1, PD TP 2 (prefill and decode)
    DeepSeek   monolithic TP 2 with EP 2 (whole experts per rank), PD TP 1

and the start-up summary names the scheme with resident bytes within 1.1x of the checkpoint's. A decode of
the FP8 checkpoint refuses a prefill of its unquantized twin, naming both weights.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import start_server
from tests.integration.fp8_models import dequantize_block, to_fp8_block
from tests.integration.moe_models import save_family
from tests.integration.test_dp_ep import hf_logprobs
from tests.integration.test_pd_families import NEW_TOKENS, pd_generate, start_role
from tests.integration.test_tensor_parallel import assert_same_tokens, generate_all
from tests.integration.tiny_model import hf_greedy, random_prompts, save_tiny_llama

LOGPROB_TOL = 1e-3  # float32 on the same dequantized weights; TP 2 sums in another order
COMMON = ("--page-size", "4", "--chunked-prefill-size", "16")
BLOCKS = {"llama": (32, 32), "deepseek_v3": (8, 8)}
MONOLITHIC_TP = {"llama": 1, "deepseek_v3": 2}
PD_TP = {"llama": 2, "deepseek_v3": 1}
SUMMARY = re.compile(r"weights: .* in (\d+) linear layers; .* ([\d.]+) MiB resident for ([\d.]+) MiB")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8")
    plain = {"llama": save_tiny_llama(root / "llama"), "deepseek_v3": save_family(root / "deepseek_v3", "deepseek_v3")}
    made = {f: to_fp8_block(path, root / f"{f}-fp8", BLOCKS[f]) for f, path in plain.items()}
    return made | {"deepseek_v3-plain": plain["deepseek_v3"]}


def flags(path, tp: int) -> tuple[str, ...]:
    return ("--model", str(path), *COMMON, "--tp-size", str(tp))


@pytest.fixture(scope="module")
def servers(dirs):
    """{family: (monolithic, (prefill, bootstrap port), decode)} and the unquantized DeepSeek's prefill."""
    made, started = {}, []
    try:
        for f in BLOCKS:
            ep = ("--ep-size", "2") if f == "deepseek_v3" else ()  # whole experts per rank, their scales too
            mono = start_server(*flags(dirs[f], MONOLITHIC_TP[f]), *ep, name=f"mono-{f}")
            prefill, boot = start_role("prefill", "mooncake", flags(dirs[f], PD_TP[f]), f"p-{f}")
            decode, _ = start_role("decode", "mooncake", flags(dirs[f], PD_TP[f]), f"d-{f}")
            made[f] = (mono, (prefill, boot), decode)
            started += [mono, prefill, decode]
        plain, boot = start_role("prefill", "mooncake", flags(dirs["deepseek_v3-plain"], 1), "p-plain")
        started.append(plain)
        for s in started:
            s.wait_ready(300)
        made = {f: (m, (p, int(p.arg("--bootstrap-port"))), d) for f, (m, (p, _), d) in made.items()}
        yield made, (plain, int(plain.arg("--bootstrap-port")))
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def references(dirs) -> dict:
    """transformers' FP8 loader (dequantizing on the CPU) per family; its weights are the format's reading."""
    out = {}
    for f, block in BLOCKS.items():
        hf = AutoModelForCausalLM.from_pretrained(dirs[f], dtype=torch.float32).eval()
        state = load_file(dirs[f] / "model.safetensors")
        name = "model.layers.0.self_attn." + ("k_proj" if f == "llama" else "kv_b_proj")
        theirs = hf.get_parameter(name + ".weight")
        assert torch.equal(theirs, dequantize_block(state[name + ".weight"], state[name + ".weight_scale_inv"], block))
        out[f] = hf
    return out


def check_against(hf, prompts, want, got: list[dict], label: str, tp: int) -> None:
    if tp == 1:
        assert [g["output_ids"] for g in got] == want, label
    else:
        assert_same_tokens(want, got, label)
    for prompt, tokens, out in zip(prompts, want, got):
        if out["output_ids"] == tokens:
            logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens))) < LOGPROB_TOL, label


def summary_of(server) -> tuple[int, float, float]:
    found = SUMMARY.search(server.log_path.read_text())
    assert found, server.log_tail()
    return int(found[1]), float(found[2]), float(found[3])


@pytest.mark.timeout(900)  # seven servers (ten processes) start first
@pytest.mark.parametrize("family", list(BLOCKS))
def test_fp8_serves_monolithic_and_pd_equal_to_transformers(servers, references, family):
    mono, prefill, decode = servers[0][family]
    prompts = random_prompts(3, 5, 60, seed=4)
    hf = references[family]
    want = hf_greedy(hf, prompts, NEW_TOKENS)
    check_against(
        hf, prompts, want, generate_all(mono.url, prompts, NEW_TOKENS), f"{family} monolithic", MONOLITHIC_TP[family]
    )
    pd = [pd_generate(prefill, decode, ids) for ids in prompts]
    assert all(r.status_code == 200 for r in pd), [r.text for r in pd]
    check_against(hf, prompts, want, [r.json() for r in pd], f"{family} PD", PD_TP[family])
    layers, resident, checkpoint = summary_of(mono if MONOLITHIC_TP[family] == 1 else decode)
    assert layers > 0 and resident <= 1.1 * checkpoint
    for s in (mono, prefill[0], decode):
        s.wait_idle()


def test_a_decode_of_fp8_weights_refuses_a_prefill_of_the_unquantized_twin(servers, dirs):
    made, plain = servers
    decode = made["deepseek_v3"][2]
    r = pd_generate(plain, decode, random_prompts(1, 20, 20, seed=5)[0])
    assert r.status_code == 502, r.text
    assert "weights: decode has 'fp8 block 8x8', prefill has 'none'" in r.json()["error"]["message"]
    decode.wait_idle(), plain[0].wait_idle()

"""The loader: weights built empty in the target dtype, filled from (sharded) safetensors piece by piece,
equal to transformers' own load; bad checkpoints are clear errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from common.model import weights
from common.model.loader import load_hf_config, load_model
from common.wire.user_error import UserError


def save(path, tied: bool, shard: str = "5GB") -> None:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=tied,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size=shard)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [weights.CHUNK_BYTES, 1000])  # 1000 bytes: every tensor in many pieces
def test_bf16_load_equals_transformers_weights_cast_to_bf16(tmp_path, monkeypatch, tied, chunk):
    save(tmp_path, tied, shard="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    monkeypatch.setattr(weights, "CHUNK_BYTES", chunk)
    model = load_model(tmp_path, load_hf_config(tmp_path), torch.bfloat16, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    ours = model.state_dict()
    assert set(ours) == set(hf)
    for name, value in ours.items():
        assert value.dtype == torch.bfloat16 and value.device.type == "cpu", name
        assert torch.equal(value, hf[name].to(torch.bfloat16)), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def save_edited(path, edit) -> None:
    """A tied checkpoint whose tensors `edit(state)` changed in place."""
    save(path, tied=True)
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors")


def test_a_missing_tensor_is_named(tmp_path):
    save_edited(tmp_path, lambda state: state.pop("model.norm.weight"))
    with pytest.raises(UserError, match=r"missing \['model.norm.weight'\]"):
        load_model(tmp_path, load_hf_config(tmp_path), torch.float32, "cpu")


def test_a_wrong_shape_or_quantized_dtype_is_named(tmp_path):
    def edit(state):
        state["model.norm.weight"] = torch.ones(65)
        state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.int8)

    save_edited(tmp_path, edit)
    with pytest.raises(UserError, match=r"wrong shape \['model.norm.weight'\].*dtypes \['I8'\]"):
        load_model(tmp_path, load_hf_config(tmp_path), torch.float32, "cpu")


def test_a_truncated_file_is_a_clear_error(tmp_path):
    save(tmp_path, tied=True)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"truncated \(\d+ bytes of \d+; an interrupted download\?\)"):
        load_model(tmp_path, load_hf_config(tmp_path), torch.float32, "cpu")


def test_q_k_v_and_gate_up_load_into_one_weight_each_and_compute_what_the_parts_compute(tmp_path):
    """At load q/k/v_proj and gate/up_proj become rows of one weight (their parameters are views of it,
    filled by their checkpoint names): one matmul each, giving the separate matmuls' tokens, and their
    logprobs to float32 rounding (a wider GEMM may block its sums differently)."""
    from common.config import ServerConfig
    from common.core.request import Req
    from common.engine.engine import Engine
    from common.wire.sampling_params import SamplingParams
    from tests.integration.tiny_model import save_tiny_llama

    model_dir = save_tiny_llama(tmp_path / "tiny")
    engine = Engine(ServerConfig(model=str(model_dir), max_total_tokens=2048))
    layer = engine.runner.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    weight, _ = attn.qkv
    q_rows = attn.q_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == weight[q_rows].data_ptr() and weight.shape[0] == sum(attn.qkv_sizes)
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[0][mlp.gate_proj.weight.shape[0]].data_ptr()

    def generate():
        req = Req("r", list(range(3, 40)), SamplingParams(max_new_tokens=8, temperature=0), return_logprob=True)
        engine.scheduler.add_request(req)
        while engine.scheduler.step():
            pass
        return req.output_ids, req.output_logprobs

    fused = generate()
    for module in engine.runner.model.modules():  # the separate matmuls, on the same (shared) weights
        if hasattr(module, "qkv"):
            module.qkv = None
        if hasattr(module, "gate_up"):
            module.gate_up = None
    tokens, logprobs = generate()
    assert tokens == fused[0] and logprobs == pytest.approx(fused[1], abs=1e-5)

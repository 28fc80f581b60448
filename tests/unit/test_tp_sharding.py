"""Which slice of a checkpoint each TP rank loads (no process group: loading needs only rank and size),
and the start-up check of --tp-size."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.model.loader import load_hf_config, load_model
from common.model.weights import fill_from_shard
from common.parallel.group import TensorParallel
from common.parallel.layers import Shard
from common.parallel.partition import TPSizeError, check_tp_size, head_partition, padded_vocab
from tests.integration.moe_models import save_family
from tests.integration.tiny_model import VOCAB, save_tiny_llama


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "expected"),
    [
        (9, 3, 3, [(3, 1, 0, 0), (3, 1, 3, 1), (3, 1, 6, 2)]),
        (8, 4, 2, [(4, 2, 0, 0), (4, 2, 4, 2)]),
        (8, 2, 4, [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 1), (2, 1, 6, 1)]),  # KV heads replicated
    ],
)
def test_head_partition(heads, kv_heads, size, expected):
    got = [head_partition(heads, kv_heads, TensorParallel(r, size)) for r in range(size)]
    assert [(h.num_heads, h.num_kv_heads, h.head_start, h.kv_head_start) for h in got] == expected


def test_tp_size_that_does_not_split_the_model_is_named():
    with pytest.raises(TPSizeError, match=r"--tp-size 4 does not divide the model's num_attention_heads 9, "):
        check_tp_size(4, 9, 3, {"intermediate_size": 1536})
    with pytest.raises(TPSizeError, match=r"num_key_value_heads 4 \(to replicate them"):
        check_tp_size(6, 12, 4, {"intermediate_size": 1536})
    with pytest.raises(TPSizeError, match=r"intermediate_size 100$"):
        check_tp_size(8, 8, 2, {"intermediate_size": 100})
    with pytest.raises(TPSizeError, match=r"divide the model.s moe_intermediate_size 33$"):
        check_tp_size(2, 8, 1, {"intermediate_size": 64, "moe_intermediate_size": 33})  # MLA: one latent
    check_tp_size(3, 9, 3, {"intermediate_size": 1536, "moe_intermediate_size": 768})
    assert padded_vocab(49152, 3) == 49152 and padded_vocab(511, 4) == 512


def test_each_rank_loads_only_its_slices(tmp_path):
    """8 heads, 2 KV heads, TP 4: every parameter is its rank's slice."""
    save_tiny_llama(tmp_path, heads=8, kv_heads=2)
    full = load_file(tmp_path / "model.safetensors")
    config = load_hf_config(tmp_path)
    for rank in range(4):
        got = load_model(tmp_path, config, torch.float32, "cpu", TensorParallel(rank, 4)).state_dict()
        layer = "model.layers.1."
        kv = slice(rank // 2 * 8, rank // 2 * 8 + 8)  # head_dim 8; ranks 0-1 share KV head 0, 2-3 head 1
        assert torch.equal(
            got[layer + "self_attn.q_proj.weight"], full[layer + "self_attn.q_proj.weight"][rank * 16 : rank * 16 + 16]
        )
        assert torch.equal(got[layer + "self_attn.k_proj.weight"], full[layer + "self_attn.k_proj.weight"][kv])
        assert torch.equal(
            got[layer + "self_attn.o_proj.weight"],
            full[layer + "self_attn.o_proj.weight"][:, rank * 16 : rank * 16 + 16],
        )
        assert torch.equal(
            got[layer + "mlp.down_proj.weight"], full[layer + "mlp.down_proj.weight"][:, rank * 32 : rank * 32 + 32]
        )
        assert torch.equal(got[layer + "input_layernorm.weight"], full[layer + "input_layernorm.weight"])
        rows = slice(rank * VOCAB // 4, (rank + 1) * VOCAB // 4)
        assert torch.equal(got["model.embed_tokens.weight"], full["model.embed_tokens.weight"][rows])
        assert torch.equal(got["lm_head.weight"], full["lm_head.weight"][rows])


def test_padded_vocabulary_rows_are_zero(tmp_path):
    """The last rank of a vocabulary of 10 rows split in 4 x 3 holds rows 9..11: row 9, then zeros."""
    table = torch.arange(40, dtype=torch.float32).view(10, 4)
    save_file({"w": table}, tmp_path / "w.safetensors")
    out = torch.full((3, 4), -1.0)
    fill_from_shard(tmp_path / "w.safetensors", ["w"], {"w": out}, {"w": Shard(0, 9, 12, (10, 4))})
    assert torch.equal(out, torch.cat([table[9:], torch.zeros(2, 4)]))


def test_deepseek_rank_holds_its_heads_and_expert_slices_and_the_whole_latent(tmp_path):
    """Tiny DeepSeek-V3 (4 heads, experts of 32 features, 2 shared), TP 2, rank 1."""
    save_family(tmp_path, "deepseek_v3")
    full = load_file(tmp_path / "model.safetensors")
    got = load_model(tmp_path, load_hf_config(tmp_path), torch.float32, "cpu", TensorParallel(1, 2)).state_dict()
    attn, moe = "model.layers.1.self_attn.", "model.layers.1.mlp."
    half = lambda name, dim=0: full[name].chunk(2, dim)[1]  # noqa: E731
    for whole in ("q_a_proj", "kv_a_proj_with_mqa", "kv_a_layernorm"):  # the latent: every rank's own copy
        assert torch.equal(got[attn + whole + ".weight"], full[attn + whole + ".weight"])
    for name in ("q_b_proj", "kv_b_proj"):  # heads 2 and 3
        assert torch.equal(got[attn + name + ".weight"], half(attn + name + ".weight"))
    assert torch.equal(got[attn + "o_proj.weight"], half(attn + "o_proj.weight", 1))
    for gate in ("gate.weight", "gate.e_score_correction_bias"):  # the router: whole
        assert torch.equal(got[moe + gate], full[moe + gate])
    for expert in ("experts.5.", "shared_experts."):
        assert torch.equal(got[moe + expert + "up_proj.weight"], half(moe + expert + "up_proj.weight"))
        assert torch.equal(got[moe + expert + "down_proj.weight"], half(moe + expert + "down_proj.weight", 1))

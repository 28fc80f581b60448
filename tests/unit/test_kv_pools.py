"""The MLA latent pool (in a TP rank's shared file too), FP8 storage with per-layer scales, and scales read from a checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from common.core.attention_spec import AttentionSpec
from common.memory.kv_pool import KVPool
from common.memory.mla_pool import MLAPool
from common.memory.pool_factory import kv_store_dtype, make_kv_pool, pool_bytes_per_token
from common.model.kv_scales import read_kv_scales
from common.wire.kv_layout import kv_layout, layout_mismatch


def test_mla_pool_keeps_one_plane_and_reads_v_as_the_latent():
    pool = MLAPool(num_layers=2, num_pages=3, page_size=4, latent_dim=6, rope_dim=2, dtype=torch.float32, device="cpu")
    assert pool.bytes_per_page == 2 * 4 * (6 + 2) * 4  # layers x page x (latent + rope) x fp32, no V copy
    at = pool.locate(torch.tensor([4, 9]))
    kv = torch.randn(2, 1, 8)
    pool.set_kv(1, at, kv, kv[..., :6])
    assert torch.equal(pool.k_at(1, at), kv)
    assert torch.equal(pool.v_at(1, at), kv[..., :6])
    assert pool.k_at(0, at).abs().sum() == 0  # the other layer is untouched


def test_fp8_pool_stores_scaled_values_and_reads_them_back_in_the_model_dtype():
    pool = KVPool(1, 2, 4, 2, 8, torch.float8_e4m3fn, "cpu", torch.float32, scales=[(2.0, 0.5)])
    at = pool.locate(torch.arange(4, 8))
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    k[0, 0, 0] = 10_000.0  # beyond fp8's range once scaled: clamped, not NaN
    pool.set_kv(0, at, k, v)
    assert pool.buffer.dtype == torch.uint8  # float8 values stored as their bytes (index_put runs on uint8)
    stored = pool.buffer.view(torch.float8_e4m3fn)
    assert torch.equal(stored[1, 0, 0, 0, 0, 1].float(), (k[0, 0, 1] / 2.0).to(torch.float8_e4m3fn).float())
    assert pool.k_pages(0).dtype == torch.float8_e4m3fn and pool.k_pages(0).data_ptr() == pool.buffer.data_ptr()
    got_k, got_v = pool.k_at(0, at), pool.v_at(0, at)
    assert got_k.dtype == torch.float32 and got_k[0, 0, 0] == 448.0 * 2.0
    assert torch.allclose(got_k.flatten()[1:], k.flatten()[1:], rtol=0.07, atol=0.02)
    assert torch.allclose(got_v, v, rtol=0.07, atol=0.01)


@pytest.mark.parametrize(
    ("kind", "dtype", "per_token"),
    [("mha", "auto", 2 * 3 * 4 * 16 * 4), ("mha", "fp8_e4m3", 2 * 3 * 4 * 16), ("mla", "fp8_e5m2", 3 * (32 + 8))],
)
def test_bytes_per_token_by_pool_kind_and_kv_cache_dtype(kind, dtype, per_token):
    spec = AttentionSpec("mha", 3, 8, 4, 16, 16, 0.25) if kind == "mha" else AttentionSpec("mla", 3, 8, 1, 40, 32, 0.1)
    store = kv_store_dtype(dtype, torch.float32)
    assert pool_bytes_per_token(spec, store) == per_token
    pool = make_kv_pool(spec, 5, 4, store, torch.float32, "cpu")
    assert pool.kind == kind and pool.bytes_per_page == 4 * per_token


def test_kv_scales_come_from_the_checkpoint_else_one(tmp_path):
    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
            "model.layers.1.self_attn.attn.v_scale": torch.tensor([4.0]),
            "model.layers.0.mlp.weight": torch.zeros(2),
        },
        tmp_path / "model.safetensors",
    )
    scales, source = read_kv_scales(tmp_path, 3)
    assert scales == [(0.25, 1.0), (1.0, 4.0), (1.0, 1.0)]
    assert source == "from the checkpoint (2 of 6)"
    assert read_kv_scales(tmp_path / "none", 1) == ([(1.0, 1.0)], "1.0 (the checkpoint has none)")


def test_pairing_layout_names_the_model_attention_kind_and_scales():
    mla = make_kv_pool(AttentionSpec("mla", 2, 4, 1, 40, 32, 0.1), 3, 4, torch.float8_e4m3fn, torch.float32, "cpu")
    mha = make_kv_pool(AttentionSpec("mha", 2, 4, 1, 40, 40, 0.1), 3, 4, torch.float32, torch.float32, "cpu")
    prefill, decode = kv_layout(mla, "mooncake", "abc"), kv_layout(mha, "mooncake", "def")
    assert prefill["kv_scales"] == "k=1,v=1" and decode["kv_scales"] == "none"
    message = layout_mismatch(decode, prefill)
    assert "model_id: decode has 'def', prefill has 'abc'" in message
    assert "attention: decode has 'mha', prefill has 'mla'" in message
    assert "dtype: decode has 'float32', prefill has 'float8_e4m3fn'" in message
    assert layout_mismatch(prefill, dict(prefill)) is None

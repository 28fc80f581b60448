"""How Tandem builds and plans FlashInfer's wrappers, checked on the CPU against a recording stand-in
(tests/unit/fake_flashinfer.py): the kernel family is pinned (fa2 unless --flashinfer-backend says
otherwise), and what the wrappers are asked to read matches the torch backend."""

from __future__ import annotations

import pytest
import torch

from common.attention.factory import make_attention_backend
from common.config import ServerConfig
from common.memory.kv_pool import KVPool
from tests.unit import fake_flashinfer

PAGE, HQ, HKV, DIM = 4, 8, 2, 64


@pytest.fixture
def fi(monkeypatch):
    return fake_flashinfer.install(monkeypatch)


def pool() -> KVPool:
    return KVPool(2, 16, PAGE, HKV, DIM, torch.float32, "cpu")


def test_the_kernel_family_is_fa2_unless_the_flag_says_otherwise(fi):
    assert ServerConfig().flashinfer_backend == "fa2"
    for family in ("fa2", "auto"):
        attn = make_attention_backend("flashinfer", "cuda", pool(), HQ, DIM, DIM**-0.5, family)
        assert attn.prefill.kwargs["backend"] == family and attn.decode.kwargs["backend"] == family
    decode = fi.BatchDecodeWithPagedKVCacheWrapper.calls
    assert [w.kwargs["use_tensor_cores"] for w in decode] == [True, True]  # 4 query heads per KV head

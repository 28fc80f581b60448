"""KV pool and context length sizing from given memory figures (no GPU needed)."""

from __future__ import annotations

import pytest

from common.memory.sizing import GIB, PoolPlan, PoolSizingError, gpu_batch_limits, plan_context_len, plan_kv_pool
from common.memory.static_reserve import (
    SAMPLER_ROW_FLOATS,
    StaticReserve,
    attention_bytes,
    cap_running_requests,
    req_to_token_bytes,
    sampler_bytes_per_row,
)

LLAMA3_8B_BF16 = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 kv heads of 128, 2 bytes: 128 KiB per token


def test_cpu_pool_is_the_default_or_max_total_tokens():
    plan = plan_kv_pool(16, 1000, None, None, 0.85)
    assert (plan.tokens, plan.num_pages) == (16384, 1024)
    assert plan.total_bytes == 1025 * 16 * 1000  # the padding page included
    assert (
        plan.describe()
        == "KV pool: 16384 tokens (1024 pages x 16), 15.6 MiB, the CPU default (--max-total-tokens 16384)"
    )
    plan = plan_kv_pool(16, 1000, 8200, None, 0.85)
    assert (plan.tokens, plan.num_pages) == (8192, 512)


def test_cuda_pool_takes_total_times_fraction_minus_what_is_used():
    total, used = 140 * GIB, 16 * GIB + 512 * 1024**2  # weights and the CUDA context
    plan = plan_kv_pool(16, LLAMA3_8B_BF16, None, (total - used, total), 0.9)
    budget = total * 0.9 - used  # 109.5 GiB
    assert plan.num_pages == (int(budget // LLAMA3_8B_BF16) - 16) // 16 == 56063
    assert plan.tokens == 897008
    assert plan.total_bytes <= budget < plan.total_bytes + 2 * 16 * LLAMA3_8B_BF16
    assert plan.describe() == (
        "KV pool: 897008 tokens (56063 pages x 16), 109.50 GiB, "
        "--mem-fraction-static 0.9 of 140.0 GiB with 16.5 GiB in use after the weights"
    )


def test_max_total_tokens_caps_the_cuda_pool_and_says_so():
    plan = plan_kv_pool(16, LLAMA3_8B_BF16, 100_000, (100 * GIB, 140 * GIB), 0.9)
    assert plan.tokens == 100_000 and "--max-total-tokens" in plan.source
    plan = plan_kv_pool(16, LLAMA3_8B_BF16, 10**9, (100 * GIB, 140 * GIB), 0.9)
    assert plan.tokens < 10**9 and "--mem-fraction-static" in plan.source


def test_no_room_after_the_weights_names_the_flag():
    with pytest.raises(PoolSizingError, match="raise --mem-fraction-static"):
        plan_kv_pool(16, LLAMA3_8B_BF16, None, (10 * GIB, 140 * GIB), 0.9)  # 130 GiB in use > 126 allowed
    with pytest.raises(PoolSizingError, match="--max-total-tokens 100 holds no page of --page-size 256"):
        plan_kv_pool(256, 1000, 100, None, 0.85)


def test_context_length_fits_is_capped_with_a_warning_or_is_an_error():
    pool = plan_kv_pool(16, 1000, 8192, None, 0.85)
    assert plan_context_len(4096, None, pool) == (4096, None)
    length, warning = plan_context_len(131072, None, pool)
    assert length == 8176 and "capped to 8176" in warning and "--max-total-tokens" in warning
    assert plan_context_len(131072, 8000, pool) == (8000, None)
    with pytest.raises(
        PoolSizingError, match="--context-length 9000 does not fit.*--max-total-tokens.*--mem-fraction-static"
    ):
        plan_context_len(131072, 9000, pool)


@pytest.mark.parametrize(
    "gib, chunk",
    [(16, 2048), (24, 2048), (48, 4096), (80, 8192), (141, 8192), (192, 16384)],  # T4, A10, L40, H100, H200, B200
)
def test_a_gpu_gets_sglangs_prefill_chunk_for_its_memory_class(gib, chunk):
    pool = PoolPlan(num_pages=400_000 // 16, page_size=16, bytes_per_token=131072, source="test")
    limits = gpu_batch_limits(gib * GIB, pool, context_len=8192)
    assert limits["chunked_prefill_size"] == chunk
    assert limits["max_prefill_tokens"] == max(16384, chunk)


@pytest.mark.parametrize(
    "pool_tokens, context_len, running",
    [
        (400_000, 8192, 4096),  # 48 contexts' worth: 24,000 rows, capped at 4096
        (100_000, 32768, 2048),  # 3 contexts' worth: 1,562 rows, raised to 2048
        (1_000_000, 131072, 3906),  # 7.6 contexts' worth
        (8_192, 4096, 512),  # a small pool: no more requests than pages
    ],
)
def test_a_gpu_runs_as_many_requests_as_its_pool_holds(pool_tokens, context_len, running):
    pool = PoolPlan(num_pages=pool_tokens // 16, page_size=16, bytes_per_token=131072, source="test")
    assert gpu_batch_limits(80 * GIB, pool, context_len)["max_running_requests"] == running


def test_the_static_buffers_allocated_after_the_pool_are_counted_before_it():
    """Llama 3 8B on an H100 at its 128k context and 4096 rows: req_to_token (2 GiB), FlashInfer's
    workspaces and the graphs come out of the pool, and the start-up line says so."""
    total, used = 80 * GIB, 16 * GIB
    reserved = StaticReserve(
        req_to_token=req_to_token_bytes(4096, 131072, 16), attention=attention_bytes("flashinfer", 3), cuda_graphs=GIB
    )
    assert reserved.req_to_token == 4105 * 131088 * 4 and reserved.attention == (256 + 5 * 8) * 2**20
    assert attention_bytes("torch", 3) == 0
    bare = plan_kv_pool(16, LLAMA3_8B_BF16, None, (total - used, total), 0.85)
    plan = plan_kv_pool(16, LLAMA3_8B_BF16, None, (total - used, total), 0.85, reserved)
    assert plan.total_bytes <= total * 0.85 - used - reserved.total < plan.total_bytes + 2 * 16 * LLAMA3_8B_BF16
    assert bare.num_pages - plan.num_pages == pytest.approx(reserved.total / LLAMA3_8B_BF16 / 16, abs=1)
    assert "(req_to_token 2.00 GiB, attention 0.29 GiB, CUDA graphs 1.00 GiB to come)" in plan.source
    with pytest.raises(PoolSizingError, match="CUDA graphs 1.00 GiB to come.*--max-running-requests"):
        plan_kv_pool(16, LLAMA3_8B_BF16, None, (14 * GIB, total), 0.85, reserved)


def test_running_requests_are_capped_to_the_rows_the_sampler_can_hold():
    per_row = SAMPLER_ROW_FLOATS * 128256 * 4
    assert sampler_bytes_per_row(128256) == per_row
    assert cap_running_requests(4096, 12 * GIB, 128256, from_flag=False) == (int(12 * GIB // per_row), None)
    assert cap_running_requests(2048, 12 * GIB, 128256, from_flag=False) == (2048, None)
    assert cap_running_requests(64, 12 * GIB, 128256, from_flag=True) == (64, None)
    rows, warning = cap_running_requests(4096, 1 * GIB, 128256, from_flag=True)
    assert rows == 209 and "--max-running-requests 4096 lowered to 209" in warning


def test_a_gpu_servers_reserve_counts_its_graphs_and_their_wrappers_unless_they_are_off():
    """Llama 3 8B's shapes at 4096 rows and 8k context on CUDA: 35 graphs of up to 256 rows (one FlashInfer
    decode wrapper each, and their memory), nothing for them with --disable-cuda-graph or at TP 2."""
    from transformers import LlamaConfig

    from common.config import ServerConfig
    from common.memory.static_reserve import graph_bytes
    from common.ranks.rank_model import static_reserve

    hf = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    on = static_reserve(ServerConfig(device="cuda"), hf, "mha", False)
    assert on.attention == attention_bytes("flashinfer", 35)
    assert on.cuda_graphs == graph_bytes(256, 4096, 14336, 128256, 2, 256 * 512) > 256 * 128256 * 10
    assert on.req_to_token == req_to_token_bytes(4096, 8192, 16)
    for flags in (dict(disable_cuda_graph=True), dict(tp_size=2), dict(attention_backend="torch")):
        off = static_reserve(ServerConfig(device="cuda", **flags), hf, "mha", False)
        assert off.cuda_graphs == 0 and off.attention in (attention_bytes("flashinfer"), 0)


def test_a_speculative_gpu_servers_reserve_counts_its_verify_graphs_too():
    """NGRAM with 3 drafts: graphs of 4 tokens per request besides the decode ones (their logits rows and
    their FlashInfer wrappers)."""
    from transformers import LlamaConfig

    from common.config import ServerConfig
    from common.memory.static_reserve import graph_bytes
    from common.ranks.rank_model import static_reserve

    hf = LlamaConfig(hidden_size=4096, intermediate_size=14336, vocab_size=128256, architectures=["LlamaForCausalLM"])
    spec = static_reserve(ServerConfig(device="cuda", speculative_algorithm="NGRAM"), hf, "mha", False)
    assert spec.attention == attention_bytes("flashinfer", 70)
    assert spec.cuda_graphs == graph_bytes(256 * (1 + 4), 4096, 14336, 128256, 2, 256 * 2048 // 16)

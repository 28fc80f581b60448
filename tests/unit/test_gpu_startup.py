"""Start-up decisions for a GPU, checked on any machine: which attention backend a dtype and device get
(or a refusal naming the flags), and the warm-up that builds every kernel before /health answers."""

from __future__ import annotations

import os
from functools import partial

import pytest

from common.attention.choice import AttentionChoiceError, choose_attention_backend
from common.config import ServerConfig
from common.core.forward_batch import ForwardMode
from common.engine.engine import Engine
from common.engine.engine_setup import batch_limits
from common.engine.warmup import FLASHINFER_CACHE_ENV
from common.memory.sizing import GIB, PoolPlan


@pytest.mark.parametrize(
    "name, device, dtype, picked, warns",
    [
        ("auto", "cuda", "bfloat16", "flashinfer", False),
        ("auto", "cuda", "float16", "flashinfer", False),
        ("auto", "cuda", "float32", "torch", True),  # FlashInfer has no float32 kernels
        ("auto", "cpu", "float32", "torch", False),
        ("auto", "cpu", "bfloat16", "torch", False),
        ("torch", "cuda", "float32", "torch", False),
        ("flashinfer", "cuda", "bfloat16", "flashinfer", False),
    ],
)
def test_the_attention_backend_for_a_device_and_dtype(name, device, dtype, picked, warns):
    chosen, warning = choose_attention_backend(name, device, dtype)
    assert chosen == picked
    assert (warning is not None) == warns
    if warns:
        assert "--dtype float32" in warning and "--dtype bfloat16" in warning


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 64, 128, 256, None])
def test_auto_takes_flashinfer_only_for_the_head_dims_it_serves(head_dim):
    chosen, warning = choose_attention_backend("auto", "cuda", "bfloat16", head_dim)
    if head_dim in (64, 128, 256, None):  # None: MLA, whose pools get the torch backend anyway
        assert (chosen, warning) == ("flashinfer", None)
    else:
        assert chosen == "torch" and f"head_dim {head_dim}" in warning and "torch" in warning
        with pytest.raises(AttentionChoiceError, match=f"head_dim is {head_dim}.*--attention-backend torch"):
            choose_attention_backend("flashinfer", "cuda", "bfloat16", head_dim)
    assert choose_attention_backend("auto", "cpu", "float32", head_dim) == ("torch", None)


def test_a_head_dim_flashinfer_lacks_is_refused_before_the_weights_load(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(
        "common.engine.engine_build.build_rank_model", lambda *a: pytest.fail("loaded a model it refuses")
    )
    with pytest.raises(AttentionChoiceError, match="head_dim is 16"):
        Engine(ServerConfig(model=str(tiny_model_dir), attention_backend="flashinfer", device="cuda"))


@pytest.mark.parametrize(
    "device, dtype, names",
    [
        ("cuda", "float32", ["--attention-backend flashinfer", "--dtype bfloat16", "--attention-backend torch"]),
        ("cpu", "bfloat16", ["--attention-backend flashinfer", "--device cuda"]),
    ],
)
def test_flashinfer_where_it_cannot_run_is_refused_naming_the_flags(device, dtype, names):
    with pytest.raises(AttentionChoiceError) as e:
        choose_attention_backend("flashinfer", device, dtype)
    assert all(n in str(e.value) for n in names)


def test_the_refusal_comes_before_the_model_loads(monkeypatch):
    monkeypatch.setattr(
        "common.engine.engine_build.build_rank_model", lambda *a: pytest.fail("loaded a model it refuses")
    )
    with pytest.raises(AttentionChoiceError):
        Engine(ServerConfig(attention_backend="flashinfer", device="cpu"))


def test_warm_up_runs_a_prefill_chunk_and_a_decode_step_and_leaves_nothing_behind(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv(FLASHINFER_CACHE_ENV, raising=False)
    cache = tmp_path / "kernels"
    engine = Engine(ServerConfig(model=str(tiny_model_dir), max_total_tokens=4096, kernel_cache_dir=str(cache)))
    assert os.environ[FLASHINFER_CACHE_ENV] == str(cache) and cache.is_dir()
    before = engine.memory.check_integrity()
    runs = []
    real_run = engine.runner.run
    monkeypatch.setattr(
        engine.runner, "run", lambda plan: runs.append((plan.mode, sum(plan.extend_lens))) or real_run(plan)
    )
    seconds = engine.warm_up()
    assert seconds > 0
    assert runs[:2] == [(ForwardMode.EXTEND, 33), (ForwardMode.DECODE, 1)]  # two pages and a partial one, a decode step
    cal = engine.scheduler.forward_stats.calibration  # then the start-up calibration's prefill and decode step
    assert runs[2:] == [(ForwardMode.EXTEND, cal.tokens), (ForwardMode.DECODE, 1)]
    after = engine.memory.check_integrity()
    assert after == before and after.free == after.total  # nothing cached, nothing held
    assert not engine.memory.live


def test_on_cuda_the_batch_limits_the_flags_leave_unset_come_from_the_device_and_pool(monkeypatch):
    """An 80 GiB device with a 400,000-token pool: chunk 8192, budget 16384, 4096 requests, except what
    the flags (or the environment) set; the CPU keeps 512 / 4096 / 32."""
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (70 * GIB, 80 * GIB))
    limits = partial(batch_limits, pool_plan=PoolPlan(25_000, 16, 131072, "test"), context_len=8192, vocab_size=32000)
    cpu = limits(ServerConfig())
    assert (cpu.chunked_prefill_size, cpu.max_prefill_tokens, cpu.max_running_requests) == (512, 4096, 32)
    gpu = limits(ServerConfig(device="cuda"))
    assert (gpu.chunked_prefill_size, gpu.max_prefill_tokens, gpu.max_running_requests) == (8192, 16384, 4096)
    monkeypatch.setenv("TANDEM_MAX_PREFILL_TOKENS", "9000")
    config = limits(ServerConfig(device="cuda", max_running_requests=64))
    assert (config.chunked_prefill_size, config.max_prefill_tokens, config.max_running_requests) == (8192, 9000, 64)


def test_on_cuda_the_running_requests_are_capped_to_what_the_sampler_can_sample(monkeypatch, caplog):
    """80 GiB at --mem-fraction-static 0.85 leaves 12 GiB; a 128,256-token vocabulary costs 10 float32 rows
    of it per request (4.9 MiB): 2,511 rows. A derived 4096 is lowered quietly, a flag's with a warning."""
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (70 * GIB, 80 * GIB))
    limits = partial(batch_limits, pool_plan=PoolPlan(25_000, 16, 131072, "test"), context_len=8192, vocab_size=128256)
    rows = int(80 * GIB * 0.15 // (10 * 128256 * 4))
    assert limits(ServerConfig(device="cuda")).max_running_requests == rows == 2511
    assert not caplog.records
    config = limits(ServerConfig(device="cuda", max_running_requests=4000))
    assert config.max_running_requests == rows
    assert "--max-running-requests 4000 lowered to 2511" in caplog.text and "--mem-fraction-static" in caplog.text
    assert limits(ServerConfig(device="cuda", max_running_requests=64)).max_running_requests == 64

"""Before the server answers /health: one forward of each kind it will run (a prefill over whole pages
and a partial one, then a decode step; both sample with top-k and top-p), so that every kernel is built
or loaded then, not inside the scheduler's first request (FlashInfer compiles a kernel the first time it sees a configuration, for
seconds or minutes, and past --watchdog-timeout-s /health would answer 503). Its kernels specialize on
dtype, head dimensions and page size, not on lengths: a short prompt builds the ones a long one uses, and
on the CPU the warm-up costs one short forward. Compiled kernels are kept in --kernel-cache-dir across
restarts (the Helm chart mounts a volume there), so only a first start pays for the build.

Then `calibrate` times one more prompt and decode step: the start-up measurement of what a prompt token and a
decode step cost on this server (common/engine/forward_stats.py).

The warm-up request is computed like any other (pool, rows, attention metadata, sampler) and leaves
nothing behind: its KV is freed, never cached, and the pool is checked to be as it was.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from common.core.forward_batch import ForwardMode
from common.core.request import Req
from common.engine.decode_tensors import DecodeTensors
from common.engine.forward_stats import Calibration
from common.engine.graph_capture import capture_graphs
from common.engine.model_runner import BatchPlan, ModelRunner
from common.memory.manager import MemoryManager
from common.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from common.config import ServerConfig
    from common.engine.engine_parts import MemoryParts
    from common.engine.scheduler import Scheduler

log = logging.getLogger(__name__)
CALIBRATION_TOKENS = 256  # the start-up measurement's prompt (at most one chunk)
FLASHINFER_CACHE_ENV = "FLASHINFER_WORKSPACE_BASE"  # FlashInfer keeps its JIT builds under <it>/.cache/flashinfer


def use_kernel_cache(directory: str | None) -> None:
    """Point the kernel builders at `directory` (before FlashInfer is imported); None keeps their default."""
    if directory:
        os.makedirs(directory, exist_ok=True)
        os.environ[FLASHINFER_CACHE_ENV] = directory


def warm_up_engine(
    c: ServerConfig, memory: MemoryParts, schedulers: list[Scheduler], hf_config: PretrainedConfig, dp_attention: bool
) -> float:
    """Every DP rank's warm-up, the CUDA graphs (none under DP attention), then the calibration; returns the seconds
    the first two took."""
    tokens = min(2 * c.page_size + 1, memory.context_len - 2)  # whole pages and a partial one
    seconds = sum(warm_up(s.runner, s.memory, tokens, c.device) for s in schedulers)
    cache = c.kernel_cache_dir or "the default location"
    log.info(
        "warm-up: kernels built or loaded in %.2f s (%d-token prefill, decode step; kernel cache: %s)",
        seconds,
        tokens,
        cache,
    )
    seconds += capture_graphs(c, memory, schedulers[0], hf_config, dp_attention)
    calibrate_engine(c, memory.context_len, schedulers)
    return seconds


def calibrate_engine(c: ServerConfig, context_len: int, schedulers: list[Scheduler]) -> None:
    """The start-up measurement (common/engine/forward_stats.py) on DP rank 0, once the kernels and graphs are
    ready; every DP rank's forward stats get it."""
    chunk = c.chunked_prefill_size if c.chunked_prefill_enabled else c.max_prefill_tokens
    tokens = min(CALIBRATION_TOKENS, chunk, context_len - 2)
    cal = calibrate(schedulers[0].runner, schedulers[0].memory, tokens, c.device)
    for s in schedulers:
        s.forward_stats.chunk_tokens, s.forward_stats.calibration = chunk, cal
    log.info(
        "calibration: a %d-token prefill at %.0f tokens/s, a decode step in %.1f ms",
        cal.tokens,
        cal.prefill_tokens_per_s,
        1000 * cal.decode_step_s,
    )


def warm_up(runner: ModelRunner, memory: MemoryManager, prefill_tokens: int, device: str) -> float:
    """A prefill forward of `prefill_tokens` tokens (within the pool) and one decode step of the same
    request; returns the seconds it took."""
    start = time.monotonic()
    timed_round(runner, memory, prefill_tokens, device)
    return time.monotonic() - start


def calibrate(runner: ModelRunner, memory: MemoryManager, prefill_tokens: int, device: str) -> Calibration:
    """After the warm-up: one prompt of `prefill_tokens` tokens and one decode step, timed (the start-up
    measurement the router prices placements with until the server's own counters move)."""
    tokens, prefill_s, decode_s = timed_round(runner, memory, prefill_tokens, device)
    return Calibration(tokens, prefill_s, decode_s)


def timed_round(
    runner: ModelRunner, memory: MemoryManager, prefill_tokens: int, device: str
) -> tuple[int, float, float]:
    """(tokens, seconds of the prefill forward, seconds of the decode step) of one request of `prefill_tokens`
    tokens (fewer if the pool is smaller), freed, never cached, and the pool checked to be as it was."""
    page_size = memory.page_size
    tokens = max(1, min(prefill_tokens, (memory.available_pages() - 1) * page_size))
    # every filter of the sampler (FlashInfer's top-k / top-p kernels are built on first use too), seeded
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=2, top_p=0.9, min_p=0.01, seed=0)
    req = Req("warm-up", [0] * tokens, params)
    memory.admit(req, match_limit=0)
    try:
        slots = memory.extend(req, tokens)
        start = time.perf_counter()
        out = runner.run(BatchPlan(ForwardMode.EXTEND, [req], [tokens], [slots], [True]))
        prefill_s = time.perf_counter() - start
        req.output_ids.append(out.token_ids[0])
        decode = DecodeTensors(device).prepare([req])
        decode.upload(memory.alloc_decode_pages([req]), page_size)
        slot = memory.write_decode_slots(decode.req_pool_indices, decode.positions, decode.new_slots)
        start = time.perf_counter()
        runner.run(BatchPlan(ForwardMode.DECODE, [req], [1], [slot], [True], decode=decode))
        decode_s = time.perf_counter() - start
    finally:
        req.kv_computed_len = 0  # nothing of it enters the prefix cache
        memory.release(req)
    memory.check_integrity()
    return tokens, prefill_s, decode_s

"""How many KV tokens the pool holds and how long a request may be: pure arithmetic, decided once at
start-up from memory figures the engine measures.

CUDA (SGLang's `--mem-fraction-static`): weights, KV pool and the other static buffers may use
`fraction` of the device's memory; the pool gets what is left of that after the weights, everything
else already on the device and the static buffers allocated after it (req_to_token, the attention
workspace, the CUDA graphs: static_reserve.py), i.e. `free - reserved - total * (1 - fraction)`. The
rest, `total * (1 - fraction)`, is for activations, the sampler's temporaries and the allocator's slack.
`--max-total-tokens` caps it. CPU: `--max-total-tokens`, CPU_DEFAULT_TOKENS when not given.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.memory.static_reserve import GPU_MAX_RUNNING, StaticReserve
from common.wire.user_error import UserError

CPU_DEFAULT_TOKENS = 16384
NOTHING_RESERVED = StaticReserve()
GIB = 1024**3


class PoolSizingError(UserError):
    """The flags ask for something the memory cannot hold; the message names the flags to change."""


@dataclass(frozen=True)
class PoolPlan:
    num_pages: int  # usable pages; the pool allocates one more (page 0, padding)
    page_size: int
    bytes_per_token: int  # K and V of one token across all layers
    source: str  # how it was sized, for the start-up summary

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return (self.num_pages + 1) * self.page_size * self.bytes_per_token

    def describe(self) -> str:
        size = (
            f"{self.total_bytes / GIB:.2f} GiB"
            if self.total_bytes >= GIB / 10
            else f"{self.total_bytes / 2**20:.1f} MiB"
        )
        return f"KV pool: {self.tokens} tokens ({self.num_pages} pages x {self.page_size}), {size}, {self.source}"


def plan_kv_pool(
    page_size: int,
    bytes_per_token: int,
    max_total_tokens: int | None,
    device_memory: tuple[int, int] | None,
    fraction: float,
    reserved: StaticReserve = NOTHING_RESERVED,
) -> PoolPlan:
    """`device_memory`: (free, total) bytes of the accelerator after the weights are loaded; None on CPU.
    `reserved`: the static buffers allocated after the pool, counted first."""
    if device_memory is None:
        tokens = max_total_tokens or CPU_DEFAULT_TOKENS
        source = (
            "from --max-total-tokens"
            if max_total_tokens
            else f"the CPU default (--max-total-tokens {CPU_DEFAULT_TOKENS})"
        )
    else:
        free, total = device_memory
        fits = int((free - reserved.total - total * (1 - fraction)) // bytes_per_token) - page_size  # minus padding
        also = f" ({reserved.describe()} to come)" if reserved.total else ""
        if fits < page_size:
            raise PoolSizingError(
                f"no room for a KV pool: {(total - free) / GIB:.1f} of {total / GIB:.1f} GiB are in use after loading the "
                f"weights{also} and --mem-fraction-static {fraction:g} allows {total * fraction / GIB:.1f} GiB; raise "
                "--mem-fraction-static, free the device, lower --max-running-requests, or use a smaller model"
            )
        tokens = fits
        source = (
            f"--mem-fraction-static {fraction:g} of {total / GIB:.1f} GiB with {(total - free) / GIB:.1f} GiB in use "
            f"after the weights{also}"
        )
        if max_total_tokens is not None and max_total_tokens < fits:
            tokens, source = max_total_tokens, f"from --max-total-tokens (the memory would hold {fits})"
    if tokens < page_size:
        raise PoolSizingError(
            f"--max-total-tokens {tokens} holds no page of --page-size {page_size}: raise it to at least {page_size}"
        )
    return PoolPlan(tokens // page_size, page_size, bytes_per_token, source)


def plan_context_len(model_max: int, requested: int | None, pool: PoolPlan) -> tuple[int, str | None]:
    """The longest request (prompt + output), and a warning when the pool caps the model's own length.
    A length asked for with --context-length that the pool cannot hold is an error."""
    capacity = pool.tokens - pool.page_size  # one page of slack, as the scheduler reserves
    if requested is not None:
        if requested > capacity:
            raise PoolSizingError(
                f"--context-length {requested} does not fit the KV pool of {pool.tokens} tokens (at most {capacity}): "
                "lower --context-length, or give the pool more room with --max-total-tokens (CPU) or "
                "--mem-fraction-static (CUDA)"
            )
        return requested, None
    if model_max > capacity:
        return capacity, (
            f"context length capped to {capacity} tokens by the KV pool of {pool.tokens} tokens (the model "
            f"allows {model_max}): raise --max-total-tokens / --mem-fraction-static, or set --context-length"
        )
    return model_max, None


# (device memory below this many GiB, chunked prefill size): SGLang's steps, by device class
GPU_CHUNK_STEPS = ((20, 2048), (35, 2048), (60, 4096), (90, 8192), (160, 8192))
GPU_CHUNK_LARGEST = 16384
GPU_MAX_PREFILL_TOKENS = 16384
BATCH_LIMITS = ("chunked_prefill_size", "max_prefill_tokens", "max_running_requests")


def gpu_batch_limits(total_bytes: int, pool: PoolPlan, context_len: int) -> dict[str, int]:
    """The batch limits a GPU gets when the flags do not set them (the CPU keeps the fields' defaults,
    512 / 4096 / 32), derived as SGLang does: the prefill chunk from the device's memory class, the
    prefill budget at least one chunk, and the running requests from how many context-long requests the
    pool holds (512 rows per context's worth of pool, within 2048..4096), never more than the pool's
    pages (each running request holds one at least)."""
    gib = total_bytes / GIB
    chunk = next((size for below, size in GPU_CHUNK_STEPS if gib < below), GPU_CHUNK_LARGEST)
    running = min(max(int(pool.tokens / context_len * 512), 2048), GPU_MAX_RUNNING, pool.num_pages)
    return {
        "chunked_prefill_size": chunk,
        "max_prefill_tokens": max(GPU_MAX_PREFILL_TOKENS, chunk),
        "max_running_requests": running,
    }

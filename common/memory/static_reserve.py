"""What a CUDA server holds beside its weights and KV pool, counted before the pool is sized (sizing.py),
and the running requests the memory left after the pool can sample for.

Counted first (they are allocated after the pool, at sizes known at start-up):
- req_to_token: one int32 row of the context's width per running request (and a few spare rows), at the
  most the flags allow (`--max-running-requests`, else the GPU's largest derived value, 4096), as wide as
  the longest context asked for (`--context-length`, else the model's);
- the attention workspace: FlashInfer's 256 MiB float workspace and 8 MiB of int workspace per wrapper
  (prefill, decode, and one decode wrapper per CUDA-graph batch size);
- the decode CUDA graphs' memory (`graph_bytes`: the static logits and the largest capture's activations)
  for the batch sizes `graph_plan` decides (common.engine.cuda_graph captures them).

Bounded by what is left: the sampler works on [rows, vocab] float32 tensors, SAMPLER_ROW_FLOATS of them
alive at once at most (tests/unit/test_memory_sizing.py counts them on a batch that asks for every
filter), which for 2048 rows of a 128k vocabulary is 10 GiB; they come out of the memory
`--mem-fraction-static` leaves unclaimed, `total * (1 - fraction)`, so `max_running_requests` is capped to
what that holds (with a warning when a flag asked for more).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
REQ_SPARE_ROWS = 8  # req_to_token rows beyond max_running_requests (the engine's ReqToTokenPool)
GPU_MAX_RUNNING = 4096  # the largest max_running_requests a GPU derives (sizing.gpu_batch_limits)
FLASHINFER_FLOAT_WORKSPACE = 256 * 1024**2  # common.attention.flashinfer_backend.WORKSPACE_BYTES
FLASHINFER_INT_WORKSPACE = 8 * 1024**2  # each FlashInfer wrapper allocates one (its __init__)
SAMPLER_ROW_FLOATS = 10  # float32 [rows, vocab] tensors alive at once in Sampler.sample, at most


@dataclass(frozen=True)
class StaticReserve:
    req_to_token: int = 0
    attention: int = 0
    cuda_graphs: int = 0

    @property
    def total(self) -> int:
        return self.req_to_token + self.attention + self.cuda_graphs

    def describe(self) -> str:
        parts = (("req_to_token", self.req_to_token), ("attention", self.attention), ("CUDA graphs", self.cuda_graphs))
        return ", ".join(f"{name} {n / GIB:.2f} GiB" for name, n in parts if n)


def req_to_token_bytes(max_running: int, context_len: int, page_size: int) -> int:
    """The table ReqToTokenPool allocates: (rows + spare + the padding row) x (context + one page) int32."""
    return (max_running + REQ_SPARE_ROWS + 1) * (context_len + page_size) * 4


def attention_bytes(backend: str, graph_wrappers: int = 0) -> int:
    """FlashInfer's workspaces (prefill and decode wrappers, and one wrapper per graph: decode and verify);
    the torch backend keeps none."""
    if backend != "flashinfer":
        return 0
    return FLASHINFER_FLOAT_WORKSPACE + (2 + graph_wrappers) * FLASHINFER_INT_WORKSPACE


def sampler_bytes_per_row(vocab_size: int) -> int:
    return SAMPLER_ROW_FLOATS * vocab_size * 4


def cap_running_requests(
    running: int, left_bytes: float, vocab_size: int, from_flag: bool, rows_per_request: int = 1
) -> tuple[int, str | None]:
    """`running` capped to the rows whose sampler temporaries `left_bytes` hold, and a warning when a
    flag's value was lowered. `rows_per_request`: a speculative verify samples the last token and k drafts."""
    per_request = sampler_bytes_per_row(vocab_size) * rows_per_request
    fits = max(1, int(left_bytes // per_request))
    if running <= fits:
        return running, None
    if not from_flag:
        return fits, None
    return fits, (
        f"--max-running-requests {running} lowered to {fits}: sampling {running * rows_per_request} rows of a "
        f"{vocab_size}-token vocabulary needs {running * per_request / GIB:.1f} GiB and --mem-fraction-static "
        f"leaves {left_bytes / GIB:.1f} GiB; lower --mem-fraction-static to raise it"
    )


DEFAULT_MAX_BS = 256
CAPTURE_SLACK = 64 * 1024**2  # cuBLAS workspaces and the allocator's rounding inside the graphs' pool


def capture_sizes(max_bs: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every 8, and `max_bs` itself."""
    sizes = [s for s in (1, 2, 4, 8, *range(16, max_bs + 1, 8)) if s <= max_bs]
    return sorted({*sizes, max_bs})


def graph_plan(config, attention: str, capturable: bool) -> tuple[list[int], str]:
    """The batch sizes to capture (empty: no graphs) and a line for the start-up log saying why."""
    reasons = {
        "--device cpu": config.device != "cuda",
        "--disable-cuda-graph": config.disable_cuda_graph,
        f"--attention-backend {attention} (graphs need flashinfer)": attention != "flashinfer",
        f"--tp-size {config.tp_size} (graphs need 1)": config.tp_size > 1,
        "a prefill server decodes nothing": config.disaggregation_mode == "prefill",
        "the model's forward reads the device back (MoE expert routing)": not capturable,
        f"{config.speculative_algorithm} keeps the target's hidden states of every forward": config.drafts_from_hidden,
    }
    off = [why for why, applies in reasons.items() if applies]
    if off:
        return [], f"CUDA graphs off: {off[0]}"
    max_bs = min(config.cuda_graph_max_bs or DEFAULT_MAX_BS, config.max_running_requests)
    sizes = capture_sizes(max_bs)
    return sizes, f"CUDA graphs for decode batches of up to {max_bs} ({len(sizes)} sizes; --cuda-graph-max-bs)"


def graph_bytes(rows: int, hidden: int, intermediate: int, vocab: int, itemsize: int, index_slots: int) -> int:
    """An estimate of the graphs' memory, for `rows` logits rows (the largest decode batch, plus k + 1 per
    request of the largest verify batch on a speculative server): the static logits, the largest capture's
    activations (its lm_head output in the weights' dtype and as float32, a layer's hidden states in
    float32, its MLP), the page-index buffer, and CAPTURE_SLACK."""
    per_row = vocab * 4 + vocab * (itemsize + 4) + 16 * hidden * 4 + 4 * intermediate * itemsize
    return rows * per_row + index_slots * 4 + CAPTURE_SLACK

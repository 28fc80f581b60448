"""CUDA attention with FlashInfer's paged prefill/decode kernels, reading the pool's pages in place.

The page-major pool gives each layer as a [num_pages + 1, H, page_size, D] view strided across pages
and heads (FlashInfer's HND paged layout; its kernels take the strides); page ids come from req_to_token.

Steps replayed from CUDA graphs (common.engine.cuda_graph) plan one wrapper per graph batch size, built
with `use_cuda_graph=True` over fixed indptr / indices / last-page-length buffers (`prepare_graphs`,
`init_graph_forward`), as SGLang does: decode graphs on the decode kernel, speculative verify graphs (k + 1
query rows per request, causal) on the paged prefill kernel.

Each wrapper's plan() fills a pinned host buffer of its own and copies it to the device asynchronously; the
next plan() on that wrapper rewrites the buffer. Nothing else orders the two on the host: a decode step ends by
reading its tokens, but consecutive prefill chunks that sample nothing (a prefill server's long prompts) do not.
So an event is recorded after every plan() and waited on before the same wrapper's next one (`_plan`).

--enable-deterministic-inference (`deterministic`): every plan() passes `disable_split_kv=True` (FlashInfer's own
batch-invariance switch, the one SGLang passes for its CUDA graphs): a query's keys are reduced by one thread block
from position 0 on, in the kernel's KV tiles, with no split to merge, so neither the batch nor a graph's padded size
changes how its sum is cut; the decode runs on the tensor-core (prefill) kernels, the only decode that honours it.
What is left is the query tile FA2 picks per plan from the batch's mean query rows per request (x query heads per
KV head): one tile for every decode step of a model (one row each: batch-invariant, graphs and eager alike), 128
rows for a prefill chunk of more than 64 packed rows, 16 or 64 for a shorter one; so the scheduler gives a prefill forward one request (prefill_queue.py), and the tile,
hence the bits, follow the chunk alone. A token computed in a prefill chunk and the same token in a decode step
go through different tiles (different bits): docs/gpu.md says what holds.

The kernel family is pinned (`--flashinfer-backend`, default fa2, as SGLang and mini-sglang pin it):
FlashInfer's "auto" builds FA3's kernels on Hopper besides FA2's (for the tensor-core decode), several
ten-file nvcc builds on a first start instead of two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import page_indices
from common.memory.kv_pool import SlotIndex

WORKSPACE_BYTES = 256 * 1024 * 1024


class PlanDone:
    """On the CPU, what a CUDA event after plan() says: a copy from host memory there is done when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def plan_event(device: torch.device):
    """The event recorded after a plan() on `device`'s current stream (torch.cuda.Event on CUDA)."""
    return torch.cuda.Event() if device.type == "cuda" else PlanDone()


@dataclass
class GraphBuffers:
    """What the graphs of one kind of step plan into: FlashInfer's fixed index buffers and the new slots."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor  # verify graphs: every request's `tokens` query rows
    out: SlotIndex


class FlashInferAttention(AttentionBackend):
    def __init__(
        self, kv_pool, num_q_heads: int, head_dim: int, scaling: float, backend: str = "fa2", deterministic=False
    ):
        super().__init__(kv_pool, num_q_heads, head_dim, scaling)
        import flashinfer

        device = kv_pool.buffer.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.backend = backend
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend=backend)
        self.deterministic = deterministic  # --enable-deterministic-inference: no KV split (the module docstring)
        self.use_tensor_cores = deterministic or num_q_heads // kv_pool.kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_tensor_cores=self.use_tensor_cores, backend=backend
        )
        self.page_size = kv_pool.page_size
        self.graph_wrappers: dict[tuple[int, int], object] = {}  # by (batch size, tokens per request)
        self.graph_buffers: dict[int, GraphBuffers] = {}  # by tokens per request
        self.planned: dict[int, object] = {}  # id(wrapper) -> the event after its last plan()

    def prepare_graphs(self, max_bs: int, index_slots: int, tokens: int = 1) -> None:
        """The fixed buffers the graphs of steps of `tokens` new tokens per request plan into (shared by
        those graphs: one runs at a time), and where the new tokens' slots go (page, offset), read by the
        captured set_kv. Decode graphs (`tokens` 1) use the decode kernel, verify graphs the prefill one."""
        dev = self.workspace.device
        self.graph_buffers[tokens] = GraphBuffers(
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            indices=torch.zeros(index_slots, dtype=torch.int32, device=dev),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=dev),
            qo_indptr=torch.arange(0, (max_bs + 1) * tokens, tokens, dtype=torch.int32, device=dev),
            out=SlotIndex(*(torch.zeros(max_bs * tokens, dtype=torch.int64, device=dev) for _ in range(2))),
        )

    def _graph_wrapper(self, size: int, tokens: int):
        import flashinfer

        if (size, tokens) in self.graph_wrappers:
            return self.graph_wrappers[size, tokens]
        b = self.graph_buffers[tokens]
        fixed = {"use_cuda_graph": True, "backend": self.backend}
        if tokens == 1:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "HND", use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=b.indptr[: size + 1], paged_kv_indices_buffer=b.indices,
                paged_kv_last_page_len_buffer=b.last_page_len[:size], **fixed,
            )  # fmt: skip
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "HND", qo_indptr_buf=b.qo_indptr[: size + 1], paged_kv_indptr_buf=b.indptr[: size + 1],
                paged_kv_indices_buf=b.indices, paged_kv_last_page_len_buf=b.last_page_len[:size], **fixed,
            )  # fmt: skip
        self.graph_wrappers[size, tokens] = wrapper
        return wrapper

    def init_graph_forward(self, batch: ForwardBatch, size: int) -> None:
        """Plan the graph of `size` rows on its own wrapper (plan copies the page table into the fixed
        buffers), and put the new tokens' (page, offset) where the captured forward reads them."""
        tokens = len(batch.out_cache_loc) // size
        wrapper = self._graph_wrapper(size, tokens)
        self._plan(wrapper, batch, tokens)
        out = self.graph_buffers[tokens].out
        page, offset = out.page[: size * tokens], out.offset[: size * tokens]
        torch.div(batch.out_cache_loc, self.page_size, rounding_mode="floor", out=page)
        torch.remainder(batch.out_cache_loc, self.page_size, out=offset)
        self._out, self._wrapper = SlotIndex(page, offset), wrapper

    def _plan(self, wrapper, batch: ForwardBatch, graph_tokens: int = 0) -> None:
        """plan() once the copy out of this wrapper's pinned plan buffer from its previous plan() is done; an
        event marks this one's. `graph_tokens`: the query rows per request of a verify graph's wrapper."""
        done = self.planned.get(id(wrapper))
        if done is None:
            done = self.planned[id(wrapper)] = plan_event(self.workspace.device)
        done.synchronize()  # returns at once when the previous copy ran (or there was none)
        if batch.mode == ForwardMode.DECODE:
            self._plan_decode(wrapper, batch)
        else:
            self._plan_prefill(wrapper, batch, graph_tokens)
        done.record()

    def _plan_decode(self, wrapper, batch: ForwardBatch) -> None:
        wrapper.plan(*self._paged(batch), pos_encoding_mode="NONE", **self._dtypes(), **self._split())

    def _plan_prefill(self, wrapper, batch: ForwardBatch, graph_tokens: int = 0) -> None:
        """`graph_tokens` > 1: a verify graph's wrapper, every request (padding rows too) `graph_tokens` query rows,
        which FlashInfer's CUDA-graph planner is told (`uniform_q_len`: its query tile for those rows, not for
        the ragged worst case)."""
        uniform = {"uniform_q_len": graph_tokens} if graph_tokens > 1 else {}
        wrapper.plan(
            batch.pages.qo_indptr, *self._paged(batch), causal=True, **self._dtypes(), **uniform, **self._split()
        )

    def _paged(self, batch: ForwardBatch) -> tuple:
        """What both wrappers' plan() take of the batch's pages, in their order: kv_indptr, the page
        indices, last_page_len, query heads, KV heads, head dim, page size."""
        meta = batch.pages
        indices = page_indices(meta, batch.req_pool_indices, batch.req_to_token, self.page_size)
        shape = (self.num_q_heads, self.kv_pool.kv_heads, self.head_dim, self.page_size)
        return (meta.kv_indptr, indices, meta.last_page_len, *shape)

    def _split(self) -> dict:
        """FlashInfer's split of the KV sequence: its own choice per plan, or none (deterministic)."""
        return {"disable_split_kv": True} if self.deterministic else {}

    def _dtypes(self) -> dict:
        return {"sm_scale": self.scaling, "q_data_type": self.kv_pool.dtype, "kv_data_type": self.kv_pool.dtype}

    def init_forward(self, batch: ForwardBatch) -> None:
        """plan() reads the indptr arrays on the host (the pinned views: no read back from the device)
        and copies them to its buffers; the page ids are gathered on the device."""
        self._out = self.kv_pool.locate(batch.out_cache_loc)
        self._wrapper = self.decode if batch.mode == ForwardMode.DECODE else self.prefill
        self._plan(self._wrapper, batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, self._out, k, v)
        cache = (pool.k_pages(layer_id), pool.v_pages(layer_id))
        return self._wrapper.run(q.to(pool.dtype).contiguous(), cache)

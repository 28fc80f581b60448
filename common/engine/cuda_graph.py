"""Decode and speculative verify steps replayed from CUDA graphs (SGLang's `--disable-cuda-graph` and
`--cuda-graph-max-bs`).

A decode step launches a few kernels per layer for a handful of tokens: on a GPU the launches, not the
work, set its time. So each batch size of `capture_sizes` (1, 2, 4, 8, then every 8 up to the largest)
gets a graph of one forward, captured after the warm-up built the kernels, largest first into one shared
memory pool (a smaller graph reuses what the larger one's capture freed there). A step of n requests
replays the smallest graph of at least n rows:

- its inputs are copied into static buffers (`StaticInputs`: the addresses the graph reads); the rows
  past n are padding: token 0 at position 0, KV written to slot 0 and read from the padding row of
  req_to_token (all slot 0), i.e. the padding page (page 0, never allocated), one token long;
- attention is planned outside the graph on the bucket's own FlashInfer decode wrapper
  (`use_cuda_graph=True`, over fixed indptr / indices / last-page-length buffers: `init_graph_forward`);
- the graph writes every row's logits into one static [largest, vocab] buffer, of which the sampler,
  outside the graph (its work follows the requests' settings), reads the first n rows.

A speculative server also captures its verify steps (`StepGraphs` with `tokens` = k + 1: every request's
last token and k drafts, causal attention on FlashInfer's paged prefill kernel, logits at every position),
at the same sizes, into the same pool, first; a padding row there holds k + 1 tokens on the padding page.
A verify where some request has fewer than k drafts (near its max_tokens, or NGRAM finding fewer) runs
eagerly, as does a draft model's proposing.

A larger batch runs eagerly. `graph_plan` (common.memory.static_reserve: the sizes decide memory counted
before the pool) says when there are graphs at all: on CUDA, with the FlashInfer
backend, at --tp-size 1 (each follower would have to replay its own), on a decode or monolithic server
(a prefill server decodes nothing), for a model whose forward makes no host-side decision (not the MoE
families: which experts run is read back per step). Their memory is counted before the KV pool is sized
(`graph_bytes`, an estimate; the start-up log gives the measured figure beside it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import PageMeta, pages_for

log = logging.getLogger(__name__)
Capture = Callable[[Callable[[], torch.Tensor], object], "Replay"]


class StaticInputs:
    """The buffers every graph reads, sized for the largest; `fill` puts one step's batch in them.
    `tokens`: new tokens per request (1 for a decode step, k + 1 for a verify step)."""

    def __init__(self, max_bs: int, padding_row: int, page_size: int, device: str, tokens: int = 1):
        self.max_bs, self.padding_row, self.tokens = max_bs, padding_row, tokens
        self.pad_pages = pages_for(tokens, page_size)  # a padding row holds `tokens` tokens, all on page 0
        self.pad_last_page_len = tokens - (self.pad_pages - 1) * page_size
        longs = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc, self.rope_lens = (longs(max_bs * tokens) for _ in range(4))
        self.rows, self.seq_lens = longs(max_bs), longs(max_bs)
        self.logits_indices = torch.arange(max_bs * tokens, device=device)
        self.pad_positions = torch.arange(tokens, device=device).repeat(max_bs)  # each padding row: 0 .. tokens - 1
        on_cuda = torch.device(device).type == "cuda"  # the host columns FlashInfer plans from: pinned
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, pin_memory=on_cuda)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, pin_memory=on_cuda)
        self.qo_indptr = torch.arange(0, (max_bs + 1) * tokens, tokens, dtype=torch.int32)
        self.kv_indptr_device = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)

    def fill(self, batch: ForwardBatch | None, size: int, req_to_token: torch.Tensor) -> ForwardBatch:
        """The static batch of `size` rows: `batch`'s requests first (None: padding only, for capture).
        The host columns are rewritten in place: the previous step's copy from them is done, since every
        step ends by reading its tokens back."""
        n, t = (0 if batch is None else batch.batch_size), self.tokens
        if batch is not None:
            meta = batch.pages
            per_token = (self.input_ids, self.positions, self.out_cache_loc, self.rope_lens)
            for buf, src in zip(per_token, (batch.input_ids, batch.positions, batch.out_cache_loc, batch.rope_lens)):
                buf[: n * t].copy_(src)
            self.rows[:n].copy_(batch.req_pool_indices)
            self.seq_lens[:n].copy_(meta.seq_lens)
            self.kv_indptr[: n + 1].copy_(meta.kv_indptr)
            self.last_page_len[:n].copy_(meta.last_page_len)
        pages = batch.pages.total_pages if batch is not None else 0
        for buf, pad in ((self.input_ids, 0), (self.out_cache_loc, 0)):
            buf[n * t : size * t].fill_(pad)
        self.positions[n * t : size * t].copy_(self.pad_positions[: (size - n) * t])
        torch.add(self.pad_positions[: (size - n) * t], 1, out=self.rope_lens[n * t : size * t])
        self.seq_lens[n:size].fill_(t)
        self.rows[n:size].fill_(self.padding_row)
        pad_ends = pages + self.pad_pages * torch.arange(1, size - n + 1, dtype=torch.int32)
        self.kv_indptr[n + 1 : size + 1] = pad_ends
        self.last_page_len[n:size] = self.pad_last_page_len
        self.kv_indptr_device[: size + 1].copy_(self.kv_indptr[: size + 1], non_blocking=True)
        host_lens = batch.seq_lens if batch is not None else torch.zeros(0, dtype=torch.int64)
        meta = PageMeta(
            seq_lens=self.seq_lens[:size],
            kv_indptr=self.kv_indptr[: size + 1],
            kv_indptr_device=self.kv_indptr_device[: size + 1],
            last_page_len=self.last_page_len[:size],
            qo_indptr=self.qo_indptr[: size + 1],
            max_len=batch.pages.max_len if batch is not None else t,  # lengths on the host: nothing read back
            min_len=t if n < size else batch.pages.min_len,
            total_pages=pages + (size - n) * self.pad_pages,
        )
        return ForwardBatch(
            mode=ForwardMode.DECODE if t == 1 else ForwardMode.VERIFY,
            input_ids=self.input_ids[: size * t],
            positions=self.positions[: size * t],
            out_cache_loc=self.out_cache_loc[: size * t],
            req_pool_indices=self.rows[:size],
            seq_lens=torch.cat([host_lens, torch.full((size - n,), t, dtype=torch.int64)]),
            extend_lens=torch.full((size,), t, dtype=torch.int64),
            logits_indices=self.logits_indices[: size * t],
            req_to_token=req_to_token,
            pages=meta,
            rope_lens=self.rope_lens[: size * t],
        )


class Replay:
    """One captured forward: `replay()` runs it again, writing the same output buffer."""

    def __init__(self, graph, output: torch.Tensor):
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


def cuda_capture(fn: Callable[[], torch.Tensor], pool) -> Replay:
    """`fn` captured into a CUDA graph using memory `pool`, after two runs on a side stream (what
    capture needs: lazily made handles and workspaces exist before it starts)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return Replay(graph, out)


class StepGraphs:
    """The graphs of one kind of step: decode (`tokens` 1) or verify (`tokens` k + 1: every request's last
    token and k drafts, FlashInfer's paged prefill kernel), one per batch size of `sizes`."""

    def __init__(
        self,
        model,
        attn: AttentionBackend,
        req_to_token: torch.Tensor,
        padding_row: int,
        sizes: list[int],
        vocab: int,
        device: str,
        capture: Capture = cuda_capture,
        tokens: int = 1,
    ):
        self.model, self.attn, self.req_to_token, self.sizes = model, attn, req_to_token, sorted(sizes)
        self.max_bs, self.tokens = self.sizes[-1], tokens
        self.inputs = StaticInputs(self.max_bs, padding_row, attn.kv_pool.page_size, device, tokens)
        self.logits = torch.zeros(self.max_bs * tokens, vocab, device=device)  # every graph's output rows
        self.capture, self.graphs = capture, {}

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether a graph runs `batch`: a step of this kind, of at most max_bs requests of `tokens` new tokens
        each (a verify where some request has fewer drafts runs eagerly)."""
        mode = ForwardMode.DECODE if self.tokens == 1 else ForwardMode.VERIFY
        if batch.mode != mode or batch.batch_size > self.max_bs:
            return False
        return self.tokens == 1 or len(batch.input_ids) == self.tokens * batch.batch_size

    def bucket(self, n: int) -> int:
        """The smallest captured size of at least n rows (n <= max_bs)."""
        return next(s for s in self.sizes if s >= n)

    def capture_all(self, pool=None) -> float:
        """Capture every size, largest first, into one memory pool; returns the seconds it took."""
        start = time.monotonic()
        if pool is None and torch.device(self.logits.device).type == "cuda":
            pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            batch = self.inputs.fill(None, size, self.req_to_token)
            self.attn.init_graph_forward(batch, size)
            self.graphs[size] = self.capture(lambda batch=batch, size=size: self._forward(batch, size), pool)
        return time.monotonic() - start

    def _forward(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        out = self.logits[: size * self.tokens]
        out.copy_(self.model(batch, self.attn))  # the lm_head's output is freed inside the pool
        return out

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of `batch`'s rows (a view of the static buffer: valid until the next replay)."""
        n = batch.batch_size
        size = self.bucket(n)
        padded = self.inputs.fill(batch, size, self.req_to_token)
        self.attn.init_graph_forward(padded, size)
        self.graphs[size].replay()
        return self.logits[: n * self.tokens]

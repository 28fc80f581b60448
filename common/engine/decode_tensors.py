"""The running requests' decode tensors, kept from step to step.

Rebuilt from the requests only when the running set changed (a request joined, finished, was aborted or
retracted); otherwise advanced in place: the input ids are the tokens the sampler produced in the last
step (they never leave the device) and the sampling tensors (penalty counts, seed counters) stay. Each
step's lengths come from the requests' host-side `kv_len`: its page-table metadata, positions and new
slots are built on the host and sent in one copy (page_meta.py), so the step reads nothing back from the
device but the sampled tokens. The scheduler asks for slots for the whole batch at once
(MemoryManager.alloc_decode_pages, then write_decode_slots).
"""

from __future__ import annotations

import torch

from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import PageMeta, build_page_meta
from common.core.request import Req
from common.engine.sampling_batch import SamplingBatch


class DecodeTensors:
    def __init__(self, device: str):
        self.device = device
        self.reqs: list[Req] = []
        self.current = False  # True between a completed step and the next: the tensors describe self.reqs
        self.sampling: SamplingBatch | None = None  # built by the runner, which knows the vocabulary
        self.pages: PageMeta | None = None  # this step's, from upload()
        self.positions: torch.Tensor | None = None
        self.new_slots: torch.Tensor | None = None

    def prepare(self, running: list[Req]) -> DecodeTensors:
        """Tensors for one decode step of `running`, reusing this step's predecessor when it ran the same requests."""
        if not (self.current and len(running) == len(self.reqs) and all(a is b for a, b in zip(running, self.reqs))):
            self._rebuild(running)
        return self

    def _rebuild(self, reqs: list[Req]) -> None:
        dev = self.device
        self.reqs = list(reqs)
        self.input_ids = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(len(reqs), device=dev)
        self.extend_lens = torch.ones(len(reqs), dtype=torch.int64)
        self.sampling = None

    def upload(self, first_slots: list[int], page_size: int) -> None:
        """This step's metadata, after the requests' `kv_len` counted its token: `first_slots` holds, per
        request, the first slot of the page just allocated for it, or -1 (MemoryManager.alloc_decode_pages)."""
        seq_lens = [r.kv_len for r in self.reqs]
        positions = [n - 1 for n in seq_lens]
        self.pages, (positions_d, first_d) = build_page_meta(
            seq_lens, [1] * len(seq_lens), page_size, self.device, [positions, first_slots]
        )
        self.positions, self.new_slots = positions_d.long(), first_d.long()

    def forward_batch(self, out_cache_loc: torch.Tensor, req_to_token: torch.Tensor) -> ForwardBatch:
        """After upload() and the slots' allocation."""
        self.current = False  # until finish_step: a step that fails midway leaves stale tensors
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=self.req_pool_indices,
            seq_lens=torch.tensor([r.kv_len for r in self.reqs], dtype=torch.int64),
            extend_lens=self.extend_lens,
            logits_indices=self.logits_indices,
            req_to_token=req_to_token,
            pages=self.pages,
            rope_lens=self.pages.seq_lens,
        )

    def finish_step(self, sampled: torch.Tensor) -> None:
        """The step ran and sampled `sampled` (on the device): advance to the next one in place."""
        self.input_ids = sampled
        self.sampling.advance(sampled)
        self.current = True

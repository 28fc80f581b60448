"""The running requests' decode tensors, kept from step to step.

Rebuilt from the requests only when the running set changed (a request joined, finished, was aborted or
retracted); otherwise advanced in place: the input ids are the tokens the sampler produced in the last
step (they never leave the device), positions and lengths grow by one, and the sampling tensors (penalty
counts, seed counters) stay. The scheduler asks for slots for the whole batch at once
(MemoryManager.extend_decode).
"""

from __future__ import annotations

import torch

from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.request import Req
from common.engine.sampling_batch import SamplingBatch


class DecodeTensors:
    def __init__(self, device: str):
        self.device = device
        self.reqs: list[Req] = []
        self.current = False  # True between a completed step and the next: the tensors describe self.reqs
        self.sampling: SamplingBatch | None = None  # built by the runner, which knows the vocabulary

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
        self.seq_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)  # host copy: KV tokens so far
        self.positions = self.seq_lens.to(dev, copy=True)  # of the tokens this step computes
        self.logits_indices = torch.arange(len(reqs), device=dev)
        self.extend_lens = torch.ones(len(reqs), dtype=torch.int64)
        self.sampling = None

    def new_page_count(self, page_size: int) -> int:
        """Pages this step needs: one per request whose last page is full."""
        return int((self.seq_lens % page_size == 0).sum())

    def forward_batch(self, out_cache_loc: torch.Tensor, req_to_token: torch.Tensor) -> ForwardBatch:
        """After the slots were allocated (seq_lens already counts this step's token)."""
        self.current = False  # until finish_step: a step that fails midway leaves stale tensors
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            extend_lens=self.extend_lens,
            logits_indices=self.logits_indices,
            req_to_token=req_to_token,
        )

    def finish_step(self, sampled: torch.Tensor) -> None:
        """The step ran and sampled `sampled` (on the device): advance to the next one in place."""
        self.input_ids = sampled
        self.positions += 1
        self.sampling.advance(sampled)
        self.current = True

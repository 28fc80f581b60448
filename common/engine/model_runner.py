"""Turns a scheduled batch into one model forward and one sampling call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import build_page_meta
from common.core.request import Req
from common.engine.cuda_graph import DecodeGraphs
from common.engine.decode_tensors import DecodeTensors
from common.engine.kv_ready import KVReady, record_kv_ready
from common.engine.sampler import Sampler, flashinfer_sampling
from common.engine.sampling_batch import SamplingBatch, SamplingRow
from common.model.llama import LlamaForCausalLM


@dataclass
class BatchPlan:
    """What the scheduler decided to run: per request, how many new tokens and where their KV goes."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    out_cache_locs: list[torch.Tensor]  # KV slots of the new tokens: concatenated, they follow reqs in order
    sample: list[bool]  # False for a prefill chunk that is not the request's last
    decode: DecodeTensors | None = None  # DECODE: the kept batch tensors (out_cache_locs holds its one slot tensor)


@dataclass
class InputLogprobs:
    """Of the prompt tokens one chunk predicted: each one's logprob and, when asked for, the top ones there."""

    values: list[float]
    tops: list[list[tuple[int, float]]] | None = None


@dataclass
class BatchResult:
    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    input_logprobs: list[InputLogprobs | None]  # per request
    kv_ready: KVReady | None = None  # EXTEND: recorded after the forward that wrote the batch's KV


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        req_to_token: torch.Tensor,
        device: str,
        eos_token_ids: frozenset[int] = frozenset(),
        check_step: Callable[[], None] = lambda: None,
    ):
        """`eos_token_ids`: what ends a request unless it ignores EOS (masked before its min_new_tokens);
        `check_step`: called once a step's tokens reached the host, raises if the step cannot be trusted
        (a TP group that faulted meanwhile: Ranks.check_step)."""
        self.check_step = check_step
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.attn = attn
        self.req_to_token = req_to_token
        self.device = device
        self.page_size = attn.kv_pool.page_size
        self.sampler = Sampler(flashinfer_sampling(device))
        self.graphs: DecodeGraphs | None = None  # captured by the engine's warm-up (common.engine.cuda_graph)

    def run(self, plan: BatchPlan) -> BatchResult:
        if plan.decode is not None:
            return self._run_decode(plan.decode, plan.out_cache_locs[0])
        batch, logit_spans = self._build(plan)
        self.attn.init_forward(batch)
        logits = self.model(batch, self.attn)
        kv_ready = record_kv_ready(self.device)  # before sampling: the transfer need not wait for it
        last_rows = torch.tensor([end - 1 for _, end in logit_spans], device=logits.device)
        sample_idx = [i for i, s in enumerate(plan.sample) if s]
        result = BatchResult(
            [None] * len(plan.reqs), [None] * len(plan.reqs), [None] * len(plan.reqs), [None] * len(plan.reqs), kv_ready
        )
        if sample_idx:
            rows = [self._sampling_row(plan.reqs[i]) for i in sample_idx]
            out = self.sampler.sample(logits[last_rows[sample_idx]], SamplingBatch(rows, logits.shape[-1], self.device))
            for j, i in enumerate(sample_idx):
                result.token_ids[i], result.logprobs[i], result.top_logprobs[i] = (
                    out.token_ids[j],
                    out.logprobs[j],
                    out.top_logprobs[j],
                )
        for i, req in enumerate(plan.reqs):
            start, end = logit_spans[i]
            if end - start > 1 or (req.logprob_start_len >= 0 and plan.mode == ForwardMode.EXTEND):
                result.input_logprobs[i] = self._input_logprobs(req, plan.extend_lens[i], logits[start:end])
        self.check_step()
        return result

    def _run_decode(self, decode: DecodeTensors, out_cache_loc: torch.Tensor) -> BatchResult:
        """One token for every running request, from tensors kept across steps: no tensor work per request."""
        batch = decode.forward_batch(out_cache_loc, self.req_to_token)  # its metadata went with the slots
        if self.graphs is not None and batch.batch_size <= self.graphs.max_bs:
            logits = self.graphs.run(batch)
        else:
            self.attn.init_forward(batch)
            logits = self.model(batch, self.attn)
        if decode.sampling is None:  # the running set changed
            decode.sampling = SamplingBatch([self._sampling_row(r) for r in decode.reqs], logits.shape[-1], self.device)
        out = self.sampler.sample(logits, decode.sampling)
        self.check_step()
        decode.finish_step(out.ids)
        return BatchResult(out.token_ids, out.logprobs, out.top_logprobs, [None] * len(decode.reqs))

    def _build(self, plan: BatchPlan) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """The batch's tensors, built on the host and sent in one copy (see page_meta.py)."""
        ids, positions, rope_lens, logits_idx, spans = [], [], [], [], []
        token_start = 0
        for req, ext in zip(plan.reqs, plan.extend_lens):
            prefix = req.kv_len - ext
            ids.extend(req.fill_ids[prefix : req.kv_len])
            positions.extend(range(prefix, req.kv_len))
            rope_lens.extend([len(req.fill_ids)] * ext)
            want_all = plan.mode == ForwardMode.EXTEND and req.logprob_start_len >= 0
            first = token_start if want_all else token_start + ext - 1
            spans.append((len(logits_idx), len(logits_idx) + token_start + ext - first))
            logits_idx.extend(range(first, token_start + ext))
            token_start += ext
        seq_lens = [r.kv_len for r in plan.reqs]
        rows = [r.req_pool_idx for r in plan.reqs]
        pages, (ids_d, positions_d, rope_lens_d, rows_d, logits_d) = build_page_meta(
            seq_lens, plan.extend_lens, self.page_size, self.device, [ids, positions, rope_lens, rows, logits_idx]
        )
        batch = ForwardBatch(
            mode=plan.mode,
            input_ids=ids_d.long(),
            positions=positions_d.long(),
            out_cache_loc=torch.cat(plan.out_cache_locs).to(self.device),
            req_pool_indices=rows_d.long(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            extend_lens=torch.tensor(plan.extend_lens, dtype=torch.int64),
            logits_indices=logits_d.long(),
            req_to_token=self.req_to_token,
            pages=pages,
            rope_lens=rope_lens_d.long(),
        )
        return batch, spans

    @staticmethod
    def _input_logprobs(req: Req, ext: int, logits: torch.Tensor) -> InputLogprobs:
        """Row j predicts the token after position kv_len - ext + j; keep those inside the prompt."""
        first_pos = req.kv_len - ext
        targets = [p + 1 for p in range(first_pos, req.kv_len) if p + 1 < len(req.prompt_ids)]
        if not targets:
            return InputLogprobs([])
        logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        ids = torch.tensor([req.prompt_ids[t] for t in targets], device=logp.device)
        values = logp.gather(1, ids[:, None])[:, 0].tolist()
        if req.top_logprobs_num <= 0:
            return InputLogprobs(values)
        top_vals, top_ids = logp.topk(req.top_logprobs_num, dim=-1)
        return InputLogprobs(values, [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())])

    def _sampling_row(self, req: Req) -> SamplingRow:
        p = req.params
        stop_ids = frozenset(p.stop_token_ids or ()) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        return SamplingRow(
            params=p,
            prompt_ids=req.prompt_ids,
            output_ids=req.output_ids,
            top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
            return_logprob=req.return_logprob,
            stop_ids=stop_ids if p.min_new_tokens > len(req.output_ids) else frozenset(),
            grammar=req.grammar,
        )

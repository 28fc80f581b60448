"""Turns a scheduled batch into one model forward and one sampling call.

`run(plan)` = `prepare(plan)` (the ForwardBatch, and how its logits become a BatchResult), the forward,
then `Prepared.finish(logits)`. Under DP attention the DP schedulers' batches run in one forward on all
ranks (common.ranks.leader.DPForward), each runner preparing and finishing its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.request import Req
from common.engine.cuda_graph import StepGraphs
from common.engine.decode_tensors import DecodeTensors
from common.engine.extend_batch import ExtendRow, build_extend_batch
from common.engine.kv_ready import KVReady, record_kv_ready
from common.engine.sampler import Sampler, flashinfer_sampling
from common.engine.sampling_batch import SamplingBatch, SamplingRow
from common.engine.spec.drafter import Drafter
from common.engine.spec.verify import Verified, VerifyPlan, accept, position_rows, verify_rows
from common.lora.manager import LoraManager
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
    verify: VerifyPlan | None = None  # DECODE with speculative drafts: verified in one EXTEND forward


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
    verified: list[Verified] | None = None  # a verify plan's: each request's accepted tokens


@dataclass
class Prepared:
    batch: ForwardBatch
    finish: Callable[[torch.Tensor], BatchResult]  # the forward's logits -> the sampled results


Forward = Callable[[ForwardBatch], torch.Tensor]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        req_to_token: torch.Tensor,
        device: str,
        eos_token_ids: frozenset[int] = frozenset(),
        drafter: Drafter | None = None,
        check_step: Callable[[], None] = lambda: None,
        forward: Forward | None = None,
        lora: LoraManager | None = None,
    ):
        """`eos_token_ids`: what ends a request unless it ignores EOS (masked before its min_new_tokens);
        `drafter`: speculative decoding's (common/engine/spec/), which follows every forward of the target;
        `check_step`: called once a step's tokens reached the host, raises if the step cannot be trusted
        (a TP group that faulted meanwhile: Ranks.check_step); `forward`: how a batch runs, if not by
        `model` on `attn` here (a DP rank's, with the other ranks idle); `lora`: --enable-lora's adapters, whose
        segments each batch carries."""
        self.check_step = check_step
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.attn = attn
        self.req_to_token = req_to_token
        self.device = device
        self.page_size = attn.kv_pool.page_size
        self.sampler = Sampler(flashinfer_sampling(device))
        self.graphs: list[StepGraphs] = []  # decode and verify graphs, captured by the engine's warm-up (cuda_graph.py)
        self.drafter = drafter
        self.forward: Forward = forward or self._forward_here
        self.hidden: torch.Tensor | None = None  # the last forward's hidden states, for a drafter that reads them
        self.lora = lora

    def _forward_here(self, batch: ForwardBatch) -> torch.Tensor:
        if self.drafter is not None and self.drafter.needs_hidden:
            return self._forward_keeping_hidden(batch)
        graphs = next((g for g in self.graphs if g.fits(batch)), None) if batch.lora is None else None
        if graphs is not None:
            logits = graphs.run(batch)
        else:
            self.attn.init_forward(batch)
            logits = self.model(batch, self.attn)
        if self.drafter is not None and batch.mode != ForwardMode.VERIFY:  # the draft's KV of the same tokens
            batch.lora = None  # the draft runs without the adapters (said at start-up: common/lora/manager.py)
            self.drafter.follow(batch, planned=graphs is None)  # (a graph planned its own attention)
        return logits

    @torch.inference_mode()
    def _forward_keeping_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The target's forward (eagerly, one rank), its hidden states of every row kept for the drafter: the
        final ones, or (EAGLE3) its captured layers' inputs side by side."""
        self.attn.init_forward(batch)
        final, captured = self.model.model.forward_capturing(batch, self.attn, self.drafter.capture)
        self.hidden = torch.cat(captured, dim=-1) if captured else final
        return self.model.lm_head(final[batch.logits_indices]).float()

    def run(self, plan: BatchPlan) -> BatchResult:
        prepared = self.prepare(plan)
        result = prepared.finish(self.forward(prepared.batch))
        if self.hidden is not None:  # NEXTN, EAGLE, EAGLE3: the head's inputs (common/engine/spec/head_drafter.py)
            self._hand_hidden(plan, result)
        return result

    def _hand_hidden(self, plan: BatchPlan, result: BatchResult) -> None:
        hidden, self.hidden = self.hidden, None
        if result.verified is not None:
            spans, kept = [v.drafted + 1 for v in result.verified], [len(v.tokens) for v in result.verified]
            self.drafter.take_hidden(plan.reqs, spans, ForwardMode.VERIFY, hidden, kept)
        else:
            self.drafter.take_hidden(plan.reqs, plan.extend_lens, plan.mode, hidden, None)

    def prepare(self, plan: BatchPlan) -> Prepared:
        prepared = self._prepare(plan)
        if self.lora is not None:  # each request's rows under its adapter (a verify's: its last token and drafts)
            reqs = plan.decode.reqs if plan.decode is not None else plan.reqs
            if plan.decode is not None:
                lens = [1] * len(reqs)
            else:
                lens = prepared.batch.extend_lens.tolist() if plan.verify is not None else plan.extend_lens
            prepared.batch.lora = self.lora.batch(reqs, lens)
        return prepared

    def _prepare(self, plan: BatchPlan) -> Prepared:
        if plan.verify is not None:
            return self._prepare_verify(plan)
        if plan.decode is not None:
            decode = plan.decode
            batch = decode.forward_batch(plan.out_cache_locs[0], self.req_to_token)  # its metadata went with the slots
            return Prepared(batch, lambda logits: self._sample_decode(decode, logits))
        batch, logit_spans = self._build(plan)
        return Prepared(batch, lambda logits: self._sample_extend(plan, logit_spans, logits))

    def _sample_extend(self, plan: BatchPlan, logit_spans: list[tuple[int, int]], logits: torch.Tensor) -> BatchResult:
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

    def _sample_decode(self, decode: DecodeTensors, logits: torch.Tensor) -> BatchResult:
        """One token for every running request, from tensors kept across steps: no tensor work per request."""
        if decode.sampling is None:  # the running set changed
            decode.sampling = SamplingBatch([self._sampling_row(r) for r in decode.reqs], logits.shape[-1], self.device)
        out = self.sampler.sample(logits, decode.sampling)
        self.check_step()
        decode.finish_step(out.ids)
        return BatchResult(out.token_ids, out.logprobs, out.top_logprobs, [None] * len(decode.reqs))

    def _prepare_verify(self, plan: BatchPlan) -> Prepared:
        """Drafts (the plan's, or the drafter's now that their slots exist), then one forward over every
        request's last token and drafts, every position sampled, each request's accepted tokens."""
        reqs, n = plan.reqs, len(plan.reqs)
        drafts = plan.verify.drafts
        if drafts is None:
            drafts = self.drafter.propose(reqs, plan.verify.limits)
        rows = verify_rows(reqs, drafts)
        batch, _ = build_extend_batch(rows, self.page_size, self.device, self.req_to_token, ForwardMode.VERIFY)

        def finish(logits: torch.Tensor) -> BatchResult:
            sampling = SamplingBatch(position_rows(reqs, drafts, self._sampling_row), logits.shape[-1], self.device)
            out = self.sampler.sample(logits, sampling)
            self.check_step()
            return BatchResult([None] * n, [None] * n, [None] * n, [None] * n, verified=accept(out, drafts))

        return Prepared(batch, finish)

    def _build(self, plan: BatchPlan) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """A prefill batch: each request's new tokens on top of what it holds, every logit when it wants the
        prompt's logprobs; length-dependent RoPE sees the whole prompt's length, whatever the chunking."""
        rows = [
            ExtendRow(
                req.req_pool_idx,
                req.fill_ids[req.kv_len - ext : req.kv_len],
                req.kv_len - ext,
                rope_len=len(req.fill_ids),
                all_logits=req.logprob_start_len >= 0,
            )
            for req, ext in zip(plan.reqs, plan.extend_lens)
        ]
        return build_extend_batch(rows, self.page_size, self.device, self.req_to_token)

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

    def _sampling_row(self, req: Req, output_ids: list[int] | None = None) -> SamplingRow:
        """`output_ids`: every token generated before the one sampled (a verify position's: with the drafts before it)."""
        p = req.params
        stop_ids = frozenset(p.stop_token_ids or ()) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        # a migrated request's earlier output too: its position, its penalties
        generated = req.generated_ids if output_ids is None else output_ids
        return SamplingRow(
            params=p,
            prompt_ids=req.prompt_ids,
            output_ids=generated,
            top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
            return_logprob=req.return_logprob,
            stop_ids=stop_ids if p.min_new_tokens > len(generated) else frozenset(),
            grammar=req.grammar,
        )

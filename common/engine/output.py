"""Per-token bookkeeping on the scheduler thread: detokenize, check stop conditions, emit events."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from common.core.request import FinishReason, OutputEvent, Req
from common.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from common.engine.grammar.req_grammar import GrammarRejected
from common.engine.metrics import EngineMetrics

if TYPE_CHECKING:
    from common.engine.model_runner import InputLogprobs

log = logging.getLogger("tandem.request")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], context_len: int, metrics: EngineMetrics | None = None):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.metrics = metrics

    def prepare(self, req: Req) -> None:
        p = req.params
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.spaces_between_special_tokens)
        req.stop_matcher = StopStringMatcher(p.stop or [], include_stop=p.no_stop_trim) if p.stop else None
        if req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs:
            req.input_logprobs = [None] * len(req.prompt_ids)
            if req.top_logprobs_num > 0:
                req.input_top_logprobs = [None] * len(req.prompt_ids)

    def add_input_logprobs(self, req: Req, extend_len: int, chunk: InputLogprobs) -> None:
        first = req.kv_len - extend_len + 1
        req.input_logprobs[first : first + len(chunk.values)] = chunk.values
        if chunk.tops is not None and req.input_top_logprobs:
            req.input_top_logprobs[first : first + len(chunk.tops)] = chunk.tops

    @staticmethod
    def input_meta(req: Req) -> dict:
        """The prompt's logprobs (all known once the prompt ran), for the client's first event and its last."""
        meta = {"input_token_logprobs": req.input_logprobs} if req.input_logprobs else {}
        if req.input_top_logprobs:
            meta["input_top_logprobs"] = req.input_top_logprobs
        return meta

    def commit_token(
        self, req: Req, token: int, logprob: float | None, top: list | None, from_peer: bool = False
    ) -> FinishReason | None:
        """Append one sampled token, emit what the client may see now, and say whether `req` is done. A token
        its grammar forbids is not appended: the request ends with the grammar's error (`from_peer`: the
        token is a PD prefill's, so the peers disagree)."""
        if req.grammar is not None:
            try:
                req.grammar.accept(token, req.output_ids, from_peer)
            except GrammarRejected as e:
                return FinishReason("abort", message=str(e), status=e.status)
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            req.timeline.mark("first_token_committed", now)
            if self.metrics:
                self.metrics.ttft.observe(now - req.arrival_time)
        elif self.metrics and req.last_token_time is not None:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        req.output_top_logprobs.append(top)
        finish = self._token_finish(req, token)
        if finish is None and req.grammar is not None and req.grammar.terminated:
            finish = FinishReason("stop", matched=token)  # the grammar is complete (without EOS: ignore_eos)
        text = ""
        if not (finish and finish.matched == token):  # a stop token is not rendered
            text, finish = self._render(req, [token], finish)
        if finish is not None:
            text += req.detokenizer.flush() if finish.type == "length" else ""
            if req.stop_matcher is not None and finish.type == "length":
                text += req.stop_matcher.flush()
        meta = self.input_meta(req) if len(req.output_ids) == 1 else {}
        self._emit(req, OutputEvent(req.rid, [token], text, [logprob], [top], meta=meta))
        return finish

    def _token_finish(self, req: Req, token: int) -> FinishReason | None:
        p = req.params
        n_out = len(req.output_ids)
        if n_out >= p.min_new_tokens:
            if p.stop_token_ids and token in p.stop_token_ids:
                return FinishReason("stop", matched=token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason("stop", matched=token)
        if n_out >= p.max_new_tokens or req.seq_len >= self.context_len:
            return FinishReason("length")
        return None

    def _render(self, req: Req, tokens: list[int], finish: FinishReason | None) -> tuple[str, FinishReason | None]:
        """The text the client may see now; a stop string ends the request only once it has its
        min_new_tokens (the text before is never searched, as in SGLang and vLLM)."""
        delta = req.detokenizer.add(tokens)
        if req.stop_matcher is None:
            return delta, finish
        if len(req.output_ids) < req.params.min_new_tokens:
            return req.stop_matcher.pass_through(delta), finish
        text, matched = req.stop_matcher.feed(delta)
        return text, FinishReason("stop", matched=matched) if matched else finish

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finish = reason
        meta = {
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.prefix_hit_len,
        }
        if req.decode_hit_len is not None:  # PD: what each side reused (the prefill's compute, the decode's transfer)
            meta |= {"prefill_cached_tokens": req.prefix_hit_len, "decode_cached_tokens": req.decode_hit_len}
        meta |= self.input_meta(req)
        now = time.monotonic()
        ttft = 1000 * (req.first_token_time - req.arrival_time) if req.first_token_time else float("nan")
        log.info(
            "request %s: %s%s, prompt %d, cached %d%s, completion %d tokens, ttft %.1f ms, e2e %.1f ms",
            req.rid,
            reason.type,
            f" ({reason.message})" if reason.message else "",
            len(req.prompt_ids),
            req.prefix_hit_len,
            f" ({req.store_hit_len} from the KV store)" if req.store_hit_len else "",
            len(req.output_ids),
            ttft,
            1000 * (now - req.arrival_time),
        )
        if self.metrics:
            self.metrics.finished.labels(reason.type).inc()
            self.metrics.e2e.observe(now - req.arrival_time)
            self.metrics.generated_tokens.inc(len(req.output_ids))
            self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self._emit(req, OutputEvent(req.rid, [], "", finish=reason, meta=meta))

    @staticmethod
    def _emit(req: Req, event: OutputEvent) -> None:
        if req.sink is not None:
            req.sink(event)

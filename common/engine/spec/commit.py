"""A verified request's tokens committed one by one (a stop among them ends it there), then its KV cut back
to what the committed tokens own, and the counts: `spec_verify_ct` and accepted drafts per request (its
meta), the accept-length histogram and totals (/metrics).

Who frees what after a verify of a request that held kv_len = s - 1 (s tokens committed before it) and
wrote slots for s - 1 .. s - 1 + d (its last token and d drafts), of which a were accepted and c <= a + 1
tokens committed:

    slots of tokens [0, s - 1 + c)        the target's KV of committed tokens         kept (kv_len = s - 1 + c)
    slots of tokens [s - 1 + c, s + d)    KV of rejected drafts (or of tokens past     pages wholly past it freed at
                                          a stop)                                      once (MemoryManager.truncate);
                                                                                       the rest of the last page is
                                                                                       written again next step
    kv_computed_len                        tokens whose KV every model wrote: the      only these ever enter the
                                          target's, and a draft model's up to the     prefix cache (release)
                                          last draft input it accepted (a head: up to
                                          its slots of committed pairs, + 1)
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from common.core.request import FinishReason, Req
from common.engine.metrics import EngineMetrics
from common.engine.output import OutputProcessor
from common.engine.spec.drafter import Drafter
from common.engine.spec.verify import Verified
from common.memory.manager import MemoryManager


class SpecStats:
    """The /metrics side: verifies, drafts proposed and accepted, and accepted drafts per verified request."""

    def __init__(self, metrics: EngineMetrics, draft_len: int):
        r = metrics.registry
        self.verifies = Counter("tandem_spec_verify", "requests verified (one per request and verify step)", registry=r)
        self.drafted = Counter("tandem_spec_draft_tokens", "draft tokens proposed for verification", registry=r)
        self.accepted = Counter("tandem_spec_accepted_tokens", "draft tokens the target accepted", registry=r)
        self.accept_length = Histogram(
            "tandem_spec_accept_length",
            "draft tokens accepted per request and verify (each verify also commits the target's own token)",
            buckets=tuple(range(draft_len + 1)),
            registry=r,
        )

    def observe(self, v: Verified) -> None:
        self.verifies.inc()
        self.drafted.inc(v.drafted)
        self.accepted.inc(v.accepted)
        self.accept_length.observe(v.accepted)


def commit_verified(
    output: OutputProcessor, memory: MemoryManager, drafter: Drafter, req: Req, v: Verified
) -> FinishReason | None:
    """Commit `v`'s tokens into `req` until one ends it; returns that finish (the caller ends the request)."""
    start = req.seq_len - 1  # the position of the last committed token, the verify's first
    finish = None
    for token, logprob, top in zip(v.tokens, v.logprobs, v.top_logprobs):
        finish = output.commit_token(req, token, logprob, top)
        if finish is not None:
            break
    req.spec_verify_ct += 1
    req.spec_accepted += v.accepted
    computed = req.seq_len - 1  # the target wrote the KV of every committed token but the newest
    if drafter.writes_kv and not drafter.needs_hidden:  # a draft model's inputs: the last token and the drafts
        # before the last, valid while accepted
        computed = min(computed, start + 1 + min(v.accepted, v.drafted - 1) if v.drafted else req.kv_computed_len)
    computed = min(computed, drafter.computed_cap(req))  # NEXTN, EAGLE, EAGLE3: its slots lag the target's
    memory.truncate(req, req.seq_len - 1)
    req.kv_computed_len = max(req.kv_computed_len, min(computed, req.kv_len))
    return finish

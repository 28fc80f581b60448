"""Which running requests get drafts and how many, and the slots a verify needs: DecodeBatch asks this first
each decode step, and runs a plain decode step (which retracts when even that does not fit) when it
answers None.

A request gets at most k drafts (`--speculative-num-draft-tokens` - 1), fewer near its max_new_tokens or
the context (never a slot past what it may still commit), and none while a grammar constrains it (its
matcher sees committed tokens only). A verify holds slots for the last token and every draft; when the
pool cannot hold them all, the step goes without drafts: speculation never retracts a request.

When verify steps replay CUDA graphs (`pad_drafts`, set by the engine once it captured them), NGRAM's
drafts are padded to each request's limit with its last draft (its last token when it has none), as
SGLang's NGRAM always proposes its full draft: a graph runs only a verify of k + 1 tokens per request, and
a padded draft is verified like any other (a guess the target may even accept).
"""

from __future__ import annotations

from common.core.forward_batch import ForwardMode
from common.core.request import Req
from common.engine.model_runner import BatchPlan
from common.engine.spec.drafter import Drafter
from common.engine.spec.verify import VerifyPlan
from common.memory.manager import MemoryManager


class SpecPlanner:
    def __init__(self, drafter: Drafter, draft_len: int, memory: MemoryManager, context_len: int):
        self.drafter, self.draft_len, self.memory, self.context_len = drafter, draft_len, memory, context_len
        self.pad_drafts = False

    def limit(self, req: Req) -> int:
        """The most drafts `req` may get this step: all of them may be committed, with the target's token."""
        if req.grammar is not None:
            return 0
        left = min(req.params.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len)
        return max(0, min(self.draft_len, left - 1))

    def plan(self, running: list[Req]) -> BatchPlan | None:
        """A verify of `running`, its slots allocated; None: a plain decode step instead (nothing to verify,
        or the drafts do not fit)."""
        limits = [self.limit(r) for r in running]
        drafts = None
        if not self.drafter.writes_kv:
            drafts = self.drafter.propose(running, limits)
            if self.pad_drafts:
                drafts = [d + [(d or [r.fill_ids[-1]])[-1]] * (k - len(d)) for r, d, k in zip(running, drafts, limits)]
            limits = [len(d) for d in drafts]
        if not any(limits):
            return None
        allocator = self.memory.allocator
        pages = sum(allocator.pages_needed(r.kv_len, r.kv_len + 1 + k) for r, k in zip(running, limits))
        if pages > self.memory.available_pages():
            return None
        slots = [self.memory.extend(r, 1 + k) for r, k in zip(running, limits)]
        n = len(running)
        return BatchPlan(
            ForwardMode.DECODE, list(running), [1] * n, slots, [True] * n, verify=VerifyPlan(limits, drafts)
        )

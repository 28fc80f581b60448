"""The verify step: the target scores each request's last committed token and its drafts in one EXTEND
forward (logits at every position), the sampler picks the target's token at every position as if the
drafts before it were committed, and each request keeps the drafts up to the first one the target did not
pick, then the target's own token there (the correction, or the bonus token after a fully accepted chain).

Position j of a request is sampled with the state the request would have after committing drafts[:j]:
its output so far plus those drafts (penalties, min_new_tokens, the seeded stream's counter). So every
committed token is the token the target samples at that position given the committed tokens before it:

- greedy: the output equals decoding without speculation, token for token, and so do the logprobs;
- sampled: a draft is kept iff the target's own draw at its position equals it. The drafters here are
  deterministic (a point mass q on the draft d), and for such q this is rejection sampling: accept d with
  probability p(d) = min(1, p(d) / q(d)), else draw from the residual max(p - q, 0) normalized, which is p
  without d. The output distribution is the target's (lossless), and with a `seed` the draws are the same
  numbers as without speculation, so the output is the same tokens too. (SGLang's target-only verification
  treats EAGLE's greedy drafts the same way.)
"""

from __future__ import annotations

from dataclasses import dataclass

from common.core.request import Req
from common.engine.extend_batch import ExtendRow
from common.engine.sampler import SampleOutput
from common.engine.sampling_batch import SamplingRow


@dataclass
class VerifyPlan:
    """A decode step that verifies drafts. `drafts`: proposed while planning (a drafter without KV), or None:
    the drafter proposes in the runner, at most `limits[i]` each (the slots for them are allocated)."""

    limits: list[int]
    drafts: list[list[int]] | None = None


@dataclass
class Verified:
    """One request's outcome: the tokens to commit (accepted drafts, then the target's own), their logprobs."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    drafted: int  # drafts proposed
    accepted: int  # drafts kept (len(tokens) - 1)


def verify_rows(reqs: list[Req], drafts: list[list[int]]) -> list[ExtendRow]:
    """Per request: its last committed token (no KV yet) and its drafts, every position's logits."""
    return [
        ExtendRow(req.req_pool_idx, [req.fill_ids[-1], *d], req.seq_len - 1, all_logits=True)
        for req, d in zip(reqs, drafts)
    ]


def position_rows(reqs: list[Req], drafts: list[list[int]], row_of) -> list[SamplingRow]:
    """The sampling rows of every verify position: request i's j-th as if drafts[i][:j] were committed.
    `row_of(req, output_ids)`: the runner's sampling row of a request with that output."""
    return [row_of(req, req.generated_ids + d[:j]) for req, d in zip(reqs, drafts) for j in range(len(d) + 1)]


def accept(out: SampleOutput, drafts: list[list[int]]) -> list[Verified]:
    """Each request's accepted prefix of drafts and the target's token after it, from the sampled positions."""
    verified, base = [], 0
    for d in drafts:
        picked = out.token_ids[base : base + len(d) + 1]
        n = 0
        while n < len(d) and picked[n] == d[n]:
            n += 1
        end = base + n + 1
        verified.append(Verified(picked[: n + 1], out.logprobs[base:end], out.top_logprobs[base:end], len(d), n))
        base += len(d) + 1
    return verified

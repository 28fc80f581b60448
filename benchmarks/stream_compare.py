"""Two answers to the same /generate request (benchmarks/migration_drill.py): identical, or where they part
and why. On the CPU a float32 matmul's row depends on how many rows the batch has (the kernel blocks
differently), so one request's logits differ in the last bits from run to run as its batch mates change; a
greedy near-tie, or a seeded draw that lands next to the boundary between two tokens, then goes the other way.
`parting` names that point and shows it is such a tie: both answers equal before it, and there the two tokens'
logprobs within NEAR of each other (greedy), or the seeded uniform within NEAR of the cumulative mass between
them (re-drawn from each answer's top logprobs exactly as common/engine/sampler.py draws: the drill asks for
as many as the request's top_k, at most 20).
"""

from __future__ import annotations

import math

import torch

from common.engine.sampler import seeded_uniforms

LOGPROB_TOL = 1e-4  # a moved stream's tokens run in other batches: its logprobs may differ in the last bits
NEAR = 1e-4  # a parting this close to a tie is float noise (the logprobs' run-to-run noise is ~1e-6)


def ok(result: dict) -> bool:
    return result["status"] == 200 and result["error"] is None and result["answer"][0] is not None


def same(a: dict, b: dict) -> bool:
    """The same tokens and text, and logprobs equal to LOGPROB_TOL."""
    (ids_a, text_a, lp_a), (ids_b, text_b, lp_b) = a["answer"], b["answer"]
    if ok(b) is False or (ids_a, text_a) != (ids_b, text_b) or len(lp_a or []) != len(lp_b or []):
        return False
    return all(abs(x[0] - y[0]) <= LOGPROB_TOL for x, y in zip(lp_a or [], lp_b or []))


def seeded_draw(top: list, seed: int, step: int, temperature: float) -> tuple[int, float]:
    """The token the sampler draws at `step` from these top logprobs (the request's top_k of them), and how far
    its uniform lies from the nearest edge of that token's share of the mass (as a share of the total)."""
    kept = sorted((int(t), lp) for lp, t, *_ in top)  # the sampler's cumulative sum runs in token-id order
    probs = [math.exp(lp / temperature) for _, lp in kept]
    u = seeded_uniforms(torch.tensor([seed]), torch.tensor([step])).item()
    target, total, below = u * sum(probs), sum(probs), 0.0
    for (token, _), p in zip(kept, probs):
        if below + p > target:
            return token, min(target - below, below + p - target) / total
        below += p
    return kept[-1][0], 0.0


def parting(body: dict, a: dict, b: dict) -> dict:
    """Where the tokens of answers `a` and `b` first differ, each one's token there, and whether that is a
    float near-tie (`near_tie`; with its `margin`), else why not."""
    ids_a, ids_b = a["answer"][0] or [], b["answer"][0] or []
    pos = next((k for k, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    out = {"first differing token": pos, "tokens there": [ids_a[pos : pos + 1], ids_b[pos : pos + 1]]}
    before = zip((a["answer"][2] or [])[:pos], (b["answer"][2] or [])[:pos])
    if pos == min(len(ids_a), len(ids_b)) or any(abs(x[0] - y[0]) > LOGPROB_TOL for x, y in before):
        return out | {"near_tie": False, "why": "a different length, or logprobs differ before the tokens do"}
    sp = body["sampling_params"]
    tops = [(x["top"] or [])[pos] for x in (a, b)]
    if sp["temperature"] == 0:
        gaps = [abs(t[0][0] - t[1][0]) if len(t) > 1 else math.inf for t in tops]
        pair = {ids_a[pos], ids_b[pos]}
        tie = all({int(t[0][1]), int(t[1][1])} == pair for t in tops if len(t) > 1)
        return out | {"greedy top-2 logprob gap": gaps, "near_tie": tie and max(gaps) < NEAR, "margin": max(gaps)}
    draws = [seeded_draw(t, sp["seed"], pos, sp["temperature"]) for t in tops]
    reproduced = [d[0] for d in draws] == [ids_a[pos], ids_b[pos]]
    margin = max(d[1] for d in draws)
    return out | {"seeded draw's distance to the edge": margin, "near_tie": reproduced and margin < NEAR}

"""Which KV heads each tensor-parallel rank holds, and where a decode rank's heads come from when the
prefill runs at another TP size (torch-free: the prefill's writer and the decode's pairing check share it).

The one definition of both rules, which the model's partition (common.parallel.partition) and the
transfer (the prefill's writer, the decode's pairing check) share: a rank of `tp_size` holds
`kv_heads / tp_size` consecutive heads; with more ranks than heads each head is replicated on
`tp_size / kv_heads` consecutive ranks (as SGLang), so `tp_size` must divide the heads or be their
multiple (`split_problem`). A decode
rank's heads are copied from the prefill rank(s) holding them: one `Segment` per run of heads that one
prefill rank holds consecutively. Among a head's replicas the prefill uses replica `decode rank % replicas`,
so at equal TP size decode rank r reads prefill rank r.
"""

from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """`count` heads copied from prefill rank `src_rank` (its local heads from `src_head`) into a decode
    rank's local heads from `dst_head`."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


def rank_heads(kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads (global indices) that `rank` of `tp_size` holds."""
    if tp_size <= kv_heads:
        per = kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    first = rank * kv_heads // tp_size
    return range(first, first + 1)


def split_problem(kv_heads: int, tp_size: int) -> str | None:
    """Why `tp_size` ranks cannot split `kv_heads` heads evenly (nor replicate them), or None."""
    if kv_heads < 1 or tp_size < 1:
        return f"kv_heads {kv_heads} and tp_size {tp_size} must be >= 1"
    if (tp_size <= kv_heads and kv_heads % tp_size) or (tp_size > kv_heads and tp_size % kv_heads):
        return f"tp_size {tp_size} neither divides nor is a multiple of kv_heads {kv_heads}"
    return None


def _holder(kv_heads: int, tp_size: int, head: int, dst_rank: int) -> tuple[int, int]:
    """(prefill rank, its local index) of the replica of `head` that decode rank `dst_rank` reads."""
    if tp_size <= kv_heads:
        per = kv_heads // tp_size
        return head // per, head % per
    replicas = tp_size // kv_heads
    return head * replicas + dst_rank % replicas, 0


def head_sources(kv_heads: int, src_tp: int, dst_tp: int) -> list[list[Segment]]:
    """For each decode rank, the segments that fill its heads, in its local head order."""
    plan = []
    for dst_rank in range(dst_tp):
        segments: list[Segment] = []
        for local, head in enumerate(rank_heads(kv_heads, dst_tp, dst_rank)):
            src_rank, src_head = _holder(kv_heads, src_tp, head, dst_rank)
            last = segments[-1] if segments else None
            if last and last.src_rank == src_rank and last.src_head + last.count == src_head:
                segments[-1] = last._replace(count=last.count + 1)
            else:
                segments.append(Segment(src_rank, src_head, local, 1))
        plan.append(segments)
    return plan


def describe_sources(plan: list[list[Segment]]) -> str:
    """'decode rank 0 <- prefill ranks [0, 1, 2]; ...': who sends each decode rank its heads."""
    return "; ".join(
        f"decode rank {d} <- prefill rank{'s' if len(s) > 1 else ''} {', '.join(str(g.src_rank) for g in s)}"
        for d, s in enumerate(plan)
    )

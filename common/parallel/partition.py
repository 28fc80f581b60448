"""Which slice of a model each rank owns, and the start-up check that `--tp-size` can split it.

Attention heads are split evenly; each rank's query heads use the KV heads common.wire.kv_heads says the
rank holds (one contiguous run; with more ranks than KV heads, `size / kv_heads` consecutive ranks share
one KV head, each holding a copy of its projection and its own KV cache, as SGLang). The vocabulary is
padded up to a multiple of the TP size, so it always divides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.wire.kv_heads import rank_heads, split_problem
from common.wire.user_error import UserError

if TYPE_CHECKING:  # torch-free: `tandem serve` checks the flag before importing torch
    from common.parallel.group import TensorParallel


class TPSizeError(UserError):
    """`--tp-size` cannot split this model; the message names the flag and the sizes."""


@dataclass(frozen=True)
class HeadPartition:
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # KV heads of this rank
    head_start: int  # first query head of this rank
    kv_head_start: int  # first KV head of this rank


def split(total: int, tp: TensorParallel) -> tuple[int, int]:
    """This rank's [start, stop) of `total` items split evenly (`total` a multiple of the size)."""
    per = total // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def head_partition(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadPartition:
    start, stop = split(num_heads, tp)
    kv = rank_heads(num_kv_heads, tp.size, tp.rank)
    return HeadPartition(stop - start, len(kv), start, kv.start)


def padded_vocab(vocab: int, tp_size: int) -> int:
    return -(-vocab // tp_size) * tp_size


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int, divided: dict[str, int]) -> None:
    """Raise TPSizeError unless `tp_size` splits the heads, the KV heads (or is a multiple of them) and
    every size in `divided` (config field -> value: the MLPs' and experts' intermediate sizes)."""
    problems = []
    if num_heads % tp_size:
        problems.append(f"num_attention_heads {num_heads}")
    if split_problem(num_kv_heads, tp_size) is not None:
        replicated = " (to replicate them, --tp-size must be their multiple)" if tp_size > num_kv_heads else ""
        problems.append(f"num_key_value_heads {num_kv_heads}{replicated}")
    problems += [f"{name} {value}" for name, value in divided.items() if value % tp_size]
    if problems:
        raise TPSizeError(f"--tp-size {tp_size} does not divide the model's {', '.join(problems)}")


def check_parallel(
    tp_size: int,
    ep_size: int,
    dp_attention: bool,
    redundant: int,
    heads: tuple[int, int],
    dense: dict[str, int],
    experts: tuple[int, dict[str, int]] | None,
) -> None:
    """Raise TPSizeError unless the ranks can split this model: its (query, KV) `heads` and `dense` sizes
    over the attention's ranks (all of them, or one under DP attention), its `experts` (count, the experts'
    sizes; None: a dense model) whole over --ep-size ranks or sliced over --tp-size."""
    check_tp_size(1 if dp_attention else tp_size, *heads, dense)
    if experts is None:
        if ep_size > 1:
            raise TPSizeError(f"--ep-size {ep_size} needs a mixture-of-experts model; this one has no experts")
        return
    count, sizes = experts
    if ep_size > 1:
        problem = placement_problem(count, ep_size, redundant)
        if problem:
            raise TPSizeError(problem)
        return
    bad = [f"{name} {value}" for name, value in sizes.items() if value % tp_size]
    if bad:
        raise TPSizeError(
            f"--tp-size {tp_size} does not divide the model's {', '.join(bad)} (or give --ep-size {tp_size})"
        )


def placement_problem(num_experts: int, ep_size: int, redundant: int) -> str | None:
    """Why `ep_size` ranks cannot hold `num_experts` experts plus `redundant` copies evenly, or None."""
    if (num_experts + redundant) % ep_size:
        return f"--ep-size {ep_size} does not divide the model's {num_experts} experts + --ep-num-redundant-experts {redundant}"
    if redundant > num_experts * (ep_size - 1):
        return (
            f"--ep-num-redundant-experts {redundant}: at most {num_experts * (ep_size - 1)} copies fit (one per rank)"
        )
    return None

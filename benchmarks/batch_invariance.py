"""Which ops change a row's bits with its batch, on this machine: each op computes the same rows alone and
inside batches of 2 to 4096 rows at random positions (among random rows), and the bits are compared. The
products (oneDNN's float32 GEMM, F.linear's MKL one, torch's batched matmul) and the row reductions (RMSNorm,
softmax, log_softmax, the sampler's sorted cumsum) at the built-in model's shapes; then SDPA's prefill vs
decode of the same token, and the fixed-split attention's (common/attention/fixed_split.py), with
--enable-deterministic-inference's switch off and on (common/parallel/invariant.py).

    .venv/bin/python benchmarks/batch_invariance.py [--threads 1 2 8] [--trials 12]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.attention.fixed_split import SPLIT, split_attention, split_kv  # noqa: E402
from common.parallel import invariant  # noqa: E402
from common.parallel.layers import linear  # noqa: E402

SIZES = (1, 2, 3, 8, 16, 17, 64, 257, 1024, 4096)
SHAPES = ((1536, 576), (576, 1536), (49152, 576))  # SmolLM2-135M's MLP and LM head (out, in)


def row_ops() -> dict[str, tuple]:
    """name -> (f(rows [M, width]) -> [M, ...], width)."""
    ops = {}
    for n, k in SHAPES:
        w = torch.randn(n, k)
        ops[f"linear {n}x{k} (oneDNN)"] = (lambda x, w=w: linear(x, w), k)
        ops[f"F.linear {n}x{k} (MKL)"] = (lambda x, w=w: F.linear(x, w), k)
    ops["rmsnorm 576"] = (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), 576)
    ops["log_softmax 49152"] = (lambda x: torch.log_softmax(x, -1), 49152)
    ops["sorted cumsum 49152"] = (lambda x: torch.softmax(x, -1).sort(-1, descending=True)[0].cumsum(-1), 49152)
    keys = torch.randn(3, 64, SPLIT)  # K^T contiguous (a transposed view of K changes with M: fixed_split.py)
    qk = lambda x: torch.matmul(x.view(-1, 3, 64).transpose(0, 1).contiguous(), keys).transpose(0, 1)  # noqa: E731
    ops["bmm q.K^T (3 heads, 256 keys)"] = (lambda x: invariant.per_row(qk, x), 192)
    return ops


def differing_sizes(op, width: int, trials: int, rng: random.Random) -> list[int]:
    """The batch sizes at which some row's bits differ from the row computed alone."""
    rows, pool = torch.randn(4, width), torch.randn(max(SIZES), width)
    alone = [op(rows[i : i + 1]) for i in range(4)]
    bad = set()
    for _ in range(trials):
        m = rng.choice(SIZES[1:] if width > 4096 else SIZES[1:-2])  # the vocabulary's rows: up to 64
        at, r = rng.randrange(m), rng.randrange(4)
        batch = pool[torch.randint(0, len(pool), (m,))].clone()
        batch[at] = rows[r]
        if not torch.equal(op(batch)[at : at + 1], alone[r]):
            bad.add(m)
    return sorted(bad)


def prefill_vs_decode(attend, s: int) -> tuple[int, int]:
    """Of some tokens of a prompt of `s`, how many differ computed in one prefill chunk and in a decode step."""
    padded = -(-s // SPLIT) * SPLIT  # the split attention's keys: whole splits (padding masked)
    q, k, v = torch.randn(1, 3, s, 64), torch.randn(1, padded, 3, 64), torch.randn(1, padded, 3, 64)
    chunk = attend(q, k, v, torch.arange(s)[None, None, :, None])
    checked = range(0, s, 16)
    one = lambda p: attend(q[:, :, p : p + 1].contiguous(), k, v, torch.full((1, 1, 1, 1), p))  # noqa: E731
    return sum(not torch.equal(one(p), chunk[:, :, p : p + 1]) for p in checked), len(checked)


def fixed_split(q, k, v, pos):
    return split_attention(q, *split_kv(k, v), pos)


def sdpa(q, k, v, pos):
    n, k, v = int(pos.max()) + 1, k.transpose(1, 2), v.transpose(1, 2)
    if q.shape[2] == 1:
        return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n])
    return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], is_causal=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--trials", type=int, default=12)
    args = p.parse_args()
    torch.manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for on in (False, True):
            invariant.enable(on)
            print(f"-- {threads} threads, batch-invariant switch {'on' if on else 'off'}")
            for name, (op, width) in row_ops().items():
                bad = differing_sizes(op, width, args.trials, random.Random(1))
                print(f"  {name:<34} rows differ at batch sizes: {bad or 'none'}")
            attend = fixed_split if on else sdpa
            bad, n = prefill_vs_decode(attend, 600)
            print(f"  attention, a token in a prefill chunk vs a decode step: {bad} of {n} differ")
    invariant.enable(False)


if __name__ == "__main__":
    main()

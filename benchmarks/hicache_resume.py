"""The overload drill in process, with and without the host tier: `--requests` requests whose final
lengths need three times the pool, all submitted at once, the scheduler stepped until they end.

Per run: retractions, the time a retracted request takes to resume (from its retraction to its next
token: its KV matched back from the host tier, or recomputed from what the device cache kept), the
drill's wall time and whether every request's tokens equal those of the other run (greedy).

    PYTHONPATH=. .venv/bin/python benchmarks/hicache_resume.py --model builtin
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams


def drill(model: str, host_tier: bool, prompts: list[list[int]], new: int, pool_tokens: int) -> dict:
    config = ServerConfig(
        model=model,
        page_size=16,
        max_total_tokens=pool_tokens,
        chunked_prefill_size=512,
        enable_hierarchical_cache=host_tier,
        hicache_ratio=8,
        hicache_write_policy="write_back",
    )
    engine = Engine(config)
    sched = engine.scheduler
    retracted: dict[int, tuple[Req, float, int]] = {}
    resumes: list[float] = []
    real_retract = sched.decode.retract

    def retract(req: Req) -> None:
        retracted[id(req)] = (req, time.perf_counter(), len(req.output_ids))
        real_retract(req)

    sched.decode.retract = retract
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    for r in reqs:
        sched.add_request(r)
    while not all(r.finished for r in reqs):
        sched.step()
        for key, (req, at, n) in list(retracted.items()):
            if len(req.output_ids) > n or req.finished:
                resumes.append(time.perf_counter() - at)
                del retracted[key]
    wall = time.perf_counter() - start
    sched.check_integrity()
    host = engine.memory.prefix_cache.host_counts() if host_tier else None
    return {
        "outputs": [r.output_ids for r in reqs],
        "failed": sum(r.finish.type == "abort" for r in reqs),
        "retractions": sched.decode.num_retractions,
        "resume_ms": [1000 * s for s in resumes],
        "wall_s": wall,
        "host": host,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="both runs this many times; the last is reported")
    ap.add_argument("--vocab", type=int, default=20000, help="prompt token ids are drawn below this")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    final = args.requests * (args.prompt_len + args.new)
    pool = final // 3 // 16 * 16
    print(f"{args.requests} requests x ({args.prompt_len} + {args.new}) tokens = {final}; pool {pool} tokens")
    runs: dict[str, dict] = {}
    for _ in range(args.rounds):  # the first round also pays for first-use costs in this process
        for name, on in (("recompute", False), ("host tier", True)):
            runs[name] = drill(args.model, on, prompts, args.new, pool)
    same = runs["host tier"]["outputs"] == runs["recompute"]["outputs"]
    for name, r in runs.items():
        ms = sorted(r["resume_ms"])
        p50 = statistics.median(ms) if ms else float("nan")
        print(
            f"{name:10s}: {r['retractions']} retractions, {r['failed']} failed, resume p50 {p50:.0f} ms "
            f"(max {max(ms, default=float('nan')):.0f} ms, n {len(ms)}), drill {r['wall_s']:.1f} s, host {r['host']}"
        )
    print(f"tokens equal across the two runs: {same}")


if __name__ == "__main__":
    main()

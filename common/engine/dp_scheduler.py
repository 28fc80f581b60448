"""DP attention's scheduling (--enable-dp-attention, docs/dp-attention.md): one Scheduler per DP rank, each
with its own queues, request rows, KV pool bookkeeping (its rank's pool), prefix cache and PD role, all
stepped by the one scheduler thread of rank 0. A request goes to one DP rank, chosen once at submit
(`pick_dp_rank`) and kept in `Req.dp_rank`.

A step plans every DP rank's batch (`Scheduler.plan_step`), runs them all in one forward on every rank
(common.ranks.leader.DPForward: a rank with no batch runs an idle one, so the MoE layers' collectives meet
on every rank), and commits each rank's results. The forward is one for the group: when it fails, every
planned batch fails.

Balancing (--load-balance-method, SGLang's): round_robin; minimum_tokens, the DP rank whose live requests
hold the fewest prompt tokens (ties: in turn); follow_bootstrap_room, the room id modulo the DP size (a
decode and its prefill agree without talking; a request without one goes in turn). A request that names
`data_parallel_rank` goes there.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from common.core.request import Req
from common.engine.model_runner import Prepared
from common.engine.scheduler import Scheduler
from common.memory.manager import PageCounts
from common.ranks.leader import DPForward


def pick_dp_rank(method: str, req: Req, loads: list[int], turn: int) -> int:
    """Where `req` goes among len(loads) DP ranks (`loads`: live prompt tokens per rank; `turn`: a counter)."""
    size = len(loads)
    if req.data_parallel_rank is not None:
        return req.data_parallel_rank
    if method == "follow_bootstrap_room" and req.rendezvous is not None:
        return req.rendezvous.room_id % size
    if method == "minimum_tokens":
        return min(range(size), key=lambda r: (loads[r], (r - turn) % size))
    return turn % size


class DPScheduler:
    def __init__(self, schedulers: list[Scheduler], forward: DPForward, method: str):
        self.schedulers, self.dp, self.method = schedulers, forward, method
        self.woken = schedulers[0].woken  # every DP scheduler's: the thread waits on one event
        self._turn = itertools.count()
        self._lock = threading.Lock()

    # -- called from other threads -------------------------------------------------------------
    def wake(self) -> None:
        self.woken.set()

    def submit(self, req: Req) -> None:
        with self._lock:
            loads = [s.live_tokens for s in self.schedulers]
            req.dp_rank = pick_dp_rank(self.method, req, loads, next(self._turn))
        self.schedulers[req.dp_rank].submit(req)

    def abort(self, req: Req, reason: str = "aborted by client", status: int = 499) -> None:
        self.schedulers[req.dp_rank].abort(req, reason, status)

    def run_on_scheduler(self, fn: Callable[[], None]) -> None:
        self.schedulers[0].run_on_scheduler(fn)  # the one thread drains every DP scheduler's inbox

    def num_queued(self) -> int:
        return sum(s.num_queued() for s in self.schedulers)

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> bool:
        plans = [s.plan_step() for s in self.schedulers]
        if not any(plans):
            return False
        prepared: list[Prepared | None] = []
        for s, plan in zip(self.schedulers, plans):
            prepared.append(self._prepare(s, plan) if plan is not None else None)
        if not any(prepared):
            return True
        try:
            logits = self.dp.forward([p.batch if p is not None else None for p in prepared])
        except Exception as e:  # the group's one forward: every planned batch fails
            for s, plan, p in zip(self.schedulers, plans, prepared):
                if p is not None:
                    s.batch_failed(plan, e)
            return True
        for s, plan, p, out in zip(self.schedulers, plans, prepared, logits):
            if p is not None:
                self._commit(s, plan, p, out)
        return True

    @staticmethod
    def _prepare(s: Scheduler, plan) -> Prepared | None:
        s.starting(plan)
        try:
            return s.runner.prepare(plan)
        except Exception as e:
            s.batch_failed(plan, e)
            return None

    @staticmethod
    def _commit(s: Scheduler, plan, prepared: Prepared, logits) -> None:
        try:
            result = prepared.finish(logits)
        except Exception as e:
            s.batch_failed(plan, e)
            return
        s.commit(plan, result)

    # -- state ---------------------------------------------------------------------------------
    def tracked_requests(self) -> list[Req]:
        return [r for s in self.schedulers for r in s.tracked_requests()]

    def abort_now(self, req: Req, reason: str, status: int) -> None:
        self.schedulers[req.dp_rank].abort_now(req, reason, status)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    def check_integrity(self) -> PageCounts:
        """Every DP rank's check; the page counts summed over them."""
        counts = [s.check_integrity() for s in self.schedulers]
        return PageCounts(
            *(sum(getattr(c, f) for c in counts) for f in ("total", "free", "evictable", "locked", "owned"))
        )

    def info(self) -> list[dict]:
        """Each DP rank's load: requests served, live and running, prompt tokens live, tokens run, KV pages."""
        return [
            {
                "dp_rank": s.dp_rank,
                "requests_served": s.served,
                "requests_live": s.num_queued() + len(s.decode.running),
                "running": len(s.decode.running),
                "live_prompt_tokens": s.live_tokens,
                "forward_tokens": self.dp.load[s.dp_rank],
                "kv_pages": s.memory.check_integrity().to_dict(),
            }
            for s in self.schedulers
        ]

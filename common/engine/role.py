"""The seam between the scheduler and a PD role (prefill_node/role.py, decode_node/role.py).

A role is composed into the scheduler, not derived from it: it keeps its own queues of requests that
wait on the peer, moves requests into the scheduler's prefill queue or decode batch when they are
ready, and frees its own resources when the scheduler ends a request. The monolithic server uses
Role itself, which does nothing.

The scheduler calls the role's methods below on its thread; the role reaches the scheduler only through
the SchedulerView it is built with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from common.core.request import FinishReason, Req
from common.memory.manager import MemoryManager

if TYPE_CHECKING:
    from common.config import ServerConfig
    from common.engine.metrics import EngineMetrics
    from common.engine.scheduler import Scheduler
    from common.lora.manager import LoraManager

Sampled = tuple[int, float | None, Any]  # (token, logprob, top logprobs) of a prompt's first sample
T = TypeVar("T")
RoleFactory = Callable[["RoleContext"], list["Role"]]  # a server's PD roles, one per DP rank's scheduler (compose.py)


class SchedulerView:
    """What a role may do to its scheduler, all on the scheduler thread except wake(): end a request
    (fail, finish; free the memory of one whose release it deferred), run a step of one guarded, hand a
    request to the prefill queue or the decode batch, commit a prompt's first token, reserve and free
    pages through the MemoryManager, and read the clock, the free request rows and whether the running
    batch is starved of pages. wake() is for the role's transfer threads (the KV manager's wake_scheduler)."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self.memory: MemoryManager = scheduler.memory
        self.clock: Callable[[], float] = scheduler.clock
        self.context_len: int = scheduler.output.context_len
        self.dp_rank: int = scheduler.dp_rank  # whose pool `memory` is (DP attention)
        self.lora: LoraManager | None = scheduler.lora  # --enable-lora's adapters: a request pins its own's slot

    def wake(self) -> None:
        self._scheduler.wake()

    def fail(self, req: Req, message: str, status: int = 502) -> None:
        self._scheduler.fail(req, message, status)

    def finish(self, req: Req, reason: FinishReason) -> None:
        self._scheduler.finish(req, reason)

    def free(self, req: Req) -> None:
        self._scheduler.free(req)

    def guarded(self, req: Req, what: str, fn: Callable[[], T]) -> T | None:
        return self._scheduler.guarded(req, what, fn)

    def queue_for_prefill(self, req: Req) -> None:
        self._scheduler.prefill.add(req)

    def join_decode(self, req: Req) -> None:
        self._scheduler.decode.add(req)

    def commit_token(
        self, req: Req, token: int, logprob: float | None, top: Any, from_peer: bool = False
    ) -> FinishReason | None:
        """`from_peer`: the token is the PD prefill's (its grammar check then blames the pair)."""
        return self._scheduler.output.commit_token(req, token, logprob, top, from_peer)

    def rows_left(self) -> int:
        return self._scheduler.slots_left()

    def starved(self) -> bool:
        """No running request fits the pool: pages that come back go to the running batch first."""
        return self._scheduler.starved_since is not None


@dataclass(frozen=True)
class RoleContext:
    """What a role composer reads (prefill_node/compose.py, decode_node/compose.py), made once the engine's
    schedulers exist: at start-up and for every role a switch builds later."""

    config: ServerConfig  # with the batch limits derived for the device
    views: list[SchedulerView]  # one per DP rank's scheduler
    kv_pool: Any  # KVPool or MLAPool: what the transfer engine registers
    kv_heads: int  # the model's KV heads as the layout counts them (common.wire.kv_layout.model_kv_heads)
    kv_layout: dict[str, Any]  # this server's KV layout (common.wire.kv_layout.kv_layout), what a peer must match
    vocab_size: int
    followers_transfer: list  # a PD follower rank's transfer engine and pool each (transfer.rank_agent)
    hidden_handoff: Any | None  # NEXTN, EAGLE, EAGLE3: the drafter whose hidden state crosses in the aux record
    aux_hidden_bytes: int  # that hidden state's bytes (0 without one)
    metrics: EngineMetrics
    wake_scheduler: Callable[[], None]  # for the KV manager's threads
    rank_fault: Callable[[], str | None]  # why a follower rank failed, or None


class Role:
    mode: str | None = None  # "prefill" or "decode": a PD role serves only requests a router paired
    instance_id: str | None = None  # a PD role's transfer instance (routers pass a prefill's to decodes)
    interleave_prefill: bool = False  # one decode step between two prefill steps (a decode's own prompts)

    def admit(self, req: Req) -> bool:
        """A new request: True if the role queued it itself, False to let the scheduler queue it for prefill."""
        return False

    def close(self) -> None:
        """The role ends (a role switch, once it holds no request): its transfer instance and threads stop."""

    def poll(self) -> None:
        """Once per step: move requests between the role's queues and the scheduler's."""

    def requests(self) -> list[Req]:
        """Every request the role holds (some already finished while their memory waits)."""
        return []

    def on_computed(self, req: Req, extend_len: int, sampled: Sampled | None) -> bool:
        """The KV of `extend_len` more tokens of `req` is in the pool; `sampled` is set when the prompt is
        complete. True if the role takes the request over from here."""
        return False

    def memory_returning(self) -> bool:
        """Whether pages come back soon with no one's action (a decode's quarantined rooms, each within its
        bound), or become retractable (a decode's rooms whose KV is arriving): the scheduler then waits
        rather than failing a running request that the pool cannot fit."""
        return False

    def release(self, req: Req, reason: FinishReason) -> bool:
        """`req` ended: free the role's resources for it. False if its memory must outlive it (a peer may
        still write into its pages); the role then frees it later through Scheduler.free()."""
        return True

    def info(self) -> dict[str, Any]:
        """What the role adds to /get_server_info."""
        return {}

    def queue_depths(self) -> dict[str, int]:
        """Requests in each of the role's queues, by queue name (read from the /metrics thread)."""
        return {}

    def check_integrity(self) -> None:
        """Raise if the role's own pools leak."""

    def health_problem(self) -> str | None:
        """Why the role cannot serve (a thread of its transfer engine died), or None."""
        return None

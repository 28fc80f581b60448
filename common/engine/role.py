"""The seam between the scheduler and a PD role (prefill_node/role.py, decode_node/role.py).

A role is composed into the scheduler, not derived from it: it keeps its own queues of requests that
wait on the peer, moves requests into the scheduler's prefill queue or decode batch when they are
ready, and frees its own resources when the scheduler ends a request. The monolithic server uses
Role itself, which does nothing.
"""

from __future__ import annotations

from typing import Any

from common.core.request import FinishReason, Req

Sampled = tuple[int, float | None, Any]  # (token, logprob, top logprobs) of a prompt's first sample


class Role:
    instance_id: str | None = None  # a PD role's transfer instance (routers pass a prefill's to decodes)

    def admit(self, req: Req) -> bool:
        """A new request: True if the role queued it itself, False to let the scheduler queue it for prefill."""
        return False

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
        """Whether pages of ended requests come back soon with no one's action (a decode's draining
        rooms, each within its bound): the scheduler then waits for them rather than failing a running
        request that the pool cannot fit."""
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

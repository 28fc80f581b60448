"""Prefill rank 0's side of its followers' agents (transfer.rank_agent): one rank slice of a chunk
sent to the agent of the rank that holds its pages, and the wait for its answer.

`write` blocks its caller (a thread of the KV writer) until the agent answers, the slice's bound passes
(`--transfer-timeout-s`, which also bounds the agent's own engine, plus GRACE_S), or the TP group
faults (`fault()`: a follower exited or hangs, common.ranks.ranks), and raises on anything but an
ok. An answer comes through rank 0's control plane (PrefillKVManager.handle -> `on_reply`) and counts
only from the agent the job was sent to.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.messages import BadMessage, Envelope, RankWrite, RankWritten

GRACE_S = 5.0
POLL_S = 0.1


class RankWriteFailed(RuntimeError):
    """A follower's rank slice did not land; the message names the rank."""

    cause = "transfer_error"


@dataclass
class Agent:
    rank: int
    endpoint: str
    instance_id: str


@dataclass
class _Job:
    agent: Agent
    done: threading.Event = field(default_factory=threading.Event)
    reply: RankWritten | None = None


class RankLinks:
    def __init__(
        self,
        agents: list[Agent],
        send: Callable[[str, object], None],
        reply_to: str,
        timeout_s: float,
        fault: Callable[[], str | None] = lambda: None,
    ):
        """`send(endpoint, msg)`: rank 0's control plane; `reply_to`: its endpoint, where answers come."""
        self.agents = {a.rank: a for a in agents}
        self.send, self.reply_to, self.fault = send, reply_to, fault
        self.timeout_s = timeout_s + GRACE_S
        self.jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)

    def write(self, rank: int, peer_id: str, address: bytes, device: int, src, dst, nbytes, on_device: bool) -> int:
        """Have rank `rank`'s engine write the pieces into `peer_id` (at `address`, its KV on CUDA device
        `device`); the bytes written, or raise."""
        agent = self.agents[rank]
        job_id = next(self._ids)
        job = self.jobs[job_id] = _Job(agent)
        try:
            self.send(
                agent.endpoint, RankWrite(job_id, peer_id, address, device, src, dst, nbytes, on_device, self.reply_to)
            )
            reply = self._wait(job, rank)
        finally:
            self.jobs.pop(job_id, None)
        if not reply.ok:
            raise RankWriteFailed(f"tp rank {rank}'s transfer engine failed: {reply.reason}")
        return reply.written

    def _wait(self, job: _Job, rank: int) -> RankWritten:
        deadline = time.monotonic() + self.timeout_s
        while not job.done.wait(POLL_S):
            fault = self.fault()
            if fault is not None:
                raise RankWriteFailed(f"tp rank {rank} cannot write: {fault}")
            if time.monotonic() > deadline:
                raise RankWriteFailed(f"tp rank {rank}'s agent did not answer within {self.timeout_s:g} s")
        return job.reply

    def on_reply(self, msg: RankWritten, envelope: Envelope) -> None:
        job = self.jobs.get(msg.job)
        if job is None:
            raise BadMessage(f"answer to unknown rank job {msg.job} (it timed out, or was never sent)")
        if envelope.sender != job.agent.instance_id:
            raise BadMessage(f"answer to rank job {msg.job} from {envelope.sender}, not its agent")
        job.reply = msg
        job.done.set()

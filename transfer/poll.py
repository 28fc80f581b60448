"""KVPoll: the state of one room's transfer, seen from either side."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable

Mark = Callable[..., None]  # mark(event, at=None): a step of the room's request, for its timeline


def no_mark(event: str, at: float | None = None) -> None:
    """The timeline of a room no request follows (a decode's request that arrived first)."""


class DuplicateRoom(ValueError):
    """A room id that another request of this server holds: client identifiers are not trusted."""


class KVPoll(enum.IntEnum):
    Failed = 0
    Pairing = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class PollState:
    """State only moves up; Failed wins and is final. Safe to read from any thread."""

    def __init__(self, state: KVPoll = KVPoll.Pairing):
        self.state = state
        self.reason: str | None = None
        self._lock = threading.Lock()

    def advance(self, new: KVPoll) -> bool:
        """Returns True if the state moved (never out of Failed, never down)."""
        with self._lock:
            if self.state == KVPoll.Failed or new <= self.state:
                return False
            self.state = new
            return True

    def fail(self, reason: str) -> bool:
        """Returns False if the room had already ended (Success or Failed)."""
        with self._lock:
            if self.state in (KVPoll.Failed, KVPoll.Success):
                return False
            self.state, self.reason = KVPoll.Failed, reason
            return True

    @property
    def done(self) -> bool:
        return self.state in (KVPoll.Failed, KVPoll.Success)

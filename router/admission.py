"""A bound on the requests in flight at the router: beyond it, answer 429 at once instead of queueing."""

from __future__ import annotations


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def try_enter(self) -> bool:
        """Take a slot if one is free; every True must be paired with one leave()."""
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1

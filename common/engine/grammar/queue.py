"""Requests waiting for their grammar to compile: the scheduler parks them here instead of waiting, so a
slow schema never stalls a step; the compilation's end wakes the scheduler, and the request goes on to
admission (the role's or the prefill queue) in arrival order. A request here holds no memory and no room."""

from __future__ import annotations

from collections.abc import Callable

from common.core.request import Req
from common.engine.grammar.backend import GrammarBackend


class GrammarQueue:
    def __init__(
        self, backend: GrammarBackend, wake: Callable[[], None], decode: Callable[[list[int]], str], reasoning_end=None
    ):
        """`reasoning_end`: the marker that ends the model's thinking (--reasoning-parser), or None."""
        self.backend, self.wake, self.decode, self.reasoning_end = backend, wake, decode, reasoning_end
        self.waiting: list[Req] = []

    def park(self, req: Req) -> bool:
        """Give `req` its grammar state; True if it must wait for the compilation (it is parked here)."""
        if req.grammar is None:
            self.backend.attach(req, self.reasoning_end, self.decode)
        if req.grammar.ready():
            return False
        self.waiting.append(req)
        req.grammar.compiled.add_done_callback(lambda _: self.wake())
        return True

    def take_ready(self) -> list[Req]:
        """The parked requests whose compilation ended (failed ones too: see ReqGrammar.error), in order."""
        ready = [r for r in self.waiting if r.grammar.ready()]
        for req in ready:
            self.waiting.remove(req)
        return ready

    def remove(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)

"""One request's grammar state: the compiled grammar it waits for, its own matcher, and how far into its
output the grammar applies.

Everything constrained decoding needs from a request lives here, so the rest of the engine asks three
questions: is it ready (`ready`, `error`), which tokens may come next (`fill`), and is this token allowed
(`accept`, from OutputProcessor.commit_token, the one place every token of every path is appended).

- n > 1: each choice's Req has its own ReqGrammar (its own matcher) over one cached compilation.
- Retraction keeps the Req, so the matcher keeps its state; a matcher built after tokens exist (the
  compilation finished late, or the thinking just ended) is first fed the tokens so far (`_catch_up`).
- Reasoning (`gate`, the end of thinking such as "</think>"): until the output's text contains it the
  grammar does not apply; the tokens after it are the constrained answer.
- PD: the prefill samples the first token under the grammar; the decode builds the same state and
  `accept`s that token like any other: one the grammar forbids fails the request (502: the peers disagree).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from common.wire.structured_output import GrammarSpec


class GrammarRejected(Exception):
    """A token the grammar does not allow; `status` 400 (the grammar left no token) or 502 (a peer's)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ReqGrammar:
    def __init__(
        self, spec: GrammarSpec, compiled: Future, gate: str | None, decode: Callable[[list[int]], str], vocab_size: int
    ):
        """`vocab_size`: the tokenizer vocabulary the grammar was compiled for (its bitmask's width)."""
        self.spec, self.compiled, self.gate, self.decode, self.vocab_size = spec, compiled, gate, decode, vocab_size
        self.matcher: Any = None  # xgrammar.GrammarMatcher, built once the compilation is done
        self.start: int | None = None if gate else 0  # index of the first output token the grammar constrains
        self.fed = 0  # output tokens from `start` on that the matcher has accepted

    @property
    def name(self) -> str:
        return f"the {self.spec.kind} grammar of {self.spec.param}"

    def ready(self) -> bool:
        return self.compiled.done()

    def error(self) -> str | None:
        """Why the grammar cannot be used (it failed to compile), once ready."""
        e = self.compiled.exception()
        return None if e is None else str(e)

    def applies(self) -> bool:
        """Whether the next token is constrained: the thinking is over and the grammar not yet complete."""
        return self.start is not None and not (self.matcher is not None and self.matcher.is_terminated())

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def fill(self, bitmask, row: int, output_ids: list[int]) -> None:
        """Row `row` of `bitmask`: the tokens the grammar allows next."""
        self._matcher(output_ids).fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int, output_ids: list[int], from_peer: bool = False) -> None:
        """`token` follows `output_ids`: advance the matcher, or raise GrammarRejected."""
        if self.start is None:
            self._watch_gate(output_ids + [token])
            return
        matcher = self._matcher(output_ids)
        if matcher.is_terminated() or matcher.accept_token(token):
            self.fed += 1
            return
        if from_peer:
            raise GrammarRejected(
                f"the prefill's first token {token} is not allowed by {self.name}: give the prefill and the decode "
                "the same --grammar-backend and --reasoning-parser",
                502,
            )
        raise GrammarRejected(
            f"{self.name} admits no token after {len(output_ids) - self.start} constrained tokens that this request "
            "allows (min_tokens or stop_token_ids may forbid the only ones it admits)",
            400,
        )

    def _watch_gate(self, output_ids: list[int]) -> None:
        """Open the gate once the thinking's end marker is in the output: constrained from the next token."""
        if self.gate in self.decode(output_ids[-8:]):  # the marker is a token or a few
            self.start = len(output_ids)

    def _matcher(self, output_ids: list[int]) -> Any:
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        self._catch_up(output_ids)
        return self.matcher

    def _catch_up(self, output_ids: list[int]) -> None:
        """Feed the matcher the constrained tokens it has not seen (it was built after they came)."""
        for token in output_ids[self.start + self.fed :]:
            if not self.matcher.accept_token(token):
                raise GrammarRejected(f"token {token} of the output so far is not allowed by {self.name}", 502)
            self.fed += 1

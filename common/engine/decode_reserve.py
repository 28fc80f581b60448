"""What a request needs to join the decode batch: the one rule of every admission to decoding (the prefill queue's,
a PD prefill's, a decode's), kept apart from all three so that none of them owns it."""

from __future__ import annotations

from common.core.request import Req

FIRST_DECODE_STEPS = 16  # token slots kept past a prompt (at most) for its first decode steps


def decode_reserve(req: Req) -> int:
    """The slots a request's first decode steps need beyond its prompt, what admission to decoding asks: the
    prefill queue keeps them free when it computes a prompt's last chunk, a PD prefill counts them in its bound
    on computing ahead, and a decode reserves them with the prompt's pages: the deadlock bound of
    prefill_node/role.py holds only while all three agree, so this is their one definition."""
    return min(req.params.max_new_tokens, FIRST_DECODE_STEPS)

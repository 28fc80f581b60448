"""Request bodies at the HTTP edge: the size limit and the deadline of read_limited."""
from __future__ import annotations

import asyncio

import pytest

from common.wire.body import read_limited
from common.wire.errors import BodyTimeout, PayloadTooLarge


async def trickle(parts: list[bytes], gap_s: float):
    for part in parts:
        await asyncio.sleep(gap_s)
        yield part


def test_a_body_in_pieces_within_its_deadline_is_read_whole():
    body = asyncio.run(read_limited("6", trickle([b"ab", b"cd", b"ef"], 0.01), 100, timeout_s=5))
    assert body == b"abcdef"


def test_a_body_still_arriving_at_its_deadline_is_a_408_naming_the_body():
    with pytest.raises(BodyTimeout) as e:
        asyncio.run(read_limited("100", trickle([b"x"] * 100, 0.05), 1000, timeout_s=0.3))
    assert (e.value.status, e.value.to_dict()["error"]["param"]) == (408, "body")
    assert "did not arrive within 0.3 s" in str(e.value)


def test_a_chunked_body_over_the_limit_is_a_413_before_its_end():
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_limited(None, trickle([b"x" * 600] * 10, 0), 1024, timeout_s=5))

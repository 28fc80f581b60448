"""Request bodies at the HTTP edge: the size limit, the deadline and the encoding of read_limited."""

from __future__ import annotations

import asyncio

import pytest

from common.wire.body import read_limited
from common.wire.errors import BodyTimeout, PayloadTooLarge, UnsupportedEncoding


async def trickle(parts: list[bytes], gap_s: float):
    for part in parts:
        await asyncio.sleep(gap_s)
        yield part


def test_a_body_in_pieces_within_its_deadline_is_read_whole():
    body = asyncio.run(read_limited({"content-length": "6"}, trickle([b"ab", b"cd", b"ef"], 0.01), 100, timeout_s=5))
    assert body == b"abcdef"


def test_a_body_still_arriving_at_its_deadline_is_a_408_naming_the_body():
    with pytest.raises(BodyTimeout) as e:
        asyncio.run(read_limited({"content-length": "100"}, trickle([b"x"] * 100, 0.05), 1000, timeout_s=0.3))
    assert (e.value.status, e.value.to_dict()["error"]["param"]) == (408, "body")
    assert "did not arrive within 0.3 s" in str(e.value)


def test_a_chunked_body_over_the_limit_is_a_413_before_its_end():
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_limited({}, trickle([b"x" * 600] * 10, 0), 1024, timeout_s=5))


def test_a_compressed_body_is_a_415_before_any_byte_is_read():
    async def never():
        raise AssertionError("the body was read")
        yield b""

    with pytest.raises(UnsupportedEncoding) as e:
        asyncio.run(read_limited({"content-encoding": "gzip", "content-length": "30"}, never(), 1024))
    assert e.value.status == 415
    assert e.value.to_dict() == {
        "error": {
            "message": "Content-Encoding 'gzip' is not supported: send the request body uncompressed (no Content-Encoding "
            "header, or identity)",
            "type": "invalid_request_error",
            "code": 415,
            "param": "content-encoding",
        }
    }


def test_identity_encoding_is_read_as_sent():
    body = asyncio.run(read_limited({"content-encoding": "Identity", "content-length": "2"}, trickle([b"{}"], 0), 100))
    assert body == b"{}"

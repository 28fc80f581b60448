"""One page as a store object: a 64-byte header, then the page's bytes (every layer's K and V of its tokens,
exactly as the host tier holds them).

    header   magic "TKV1" | version u16 | header length u16 | payload length u64 | CRC-32 of the payload u32
             | the page digest (16 bytes) | zero padding to 64 bytes                           (little-endian)

A page is loaded only when its header is whole, names the page asked for, gives the page's length and
its CRC matches the bytes read: an object another layout wrote, a truncated or overwritten object and a
bit flipped in the store are all refused (`verify` says which), never loaded.
"""

from __future__ import annotations

import struct
import zlib

from common.memory.store.keys import DIGEST_BYTES

MAGIC, VERSION = b"TKV1", 1
HEADER_BYTES = 64
_FIELDS = struct.Struct(f"<4sHHQI{DIGEST_BYTES}s")


def page_crc(payload: memoryview) -> int:
    return zlib.crc32(payload)  # releases the GIL on large buffers


def pack_header(digest: bytes, payload: memoryview) -> bytes:
    fields = _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, payload.nbytes, page_crc(payload), digest[:DIGEST_BYTES])
    return fields.ljust(HEADER_BYTES, b"\0")


def verify(header: memoryview | bytes, digest: bytes, payload: memoryview) -> str | None:
    """Why the object read into (header, payload) must not be loaded as the page `digest`, or None."""
    if len(header) < HEADER_BYTES:
        return "the header is cut short"
    magic, version, header_len, length, crc, key = _FIELDS.unpack_from(header)
    if (magic, version, header_len) != (MAGIC, VERSION, HEADER_BYTES):
        return f"not a version-{VERSION} Tandem page"
    if key != digest[:DIGEST_BYTES]:
        return "the header names another page"
    if length != payload.nbytes:
        return f"the header gives {length} bytes, a page has {payload.nbytes}"
    if crc != page_crc(payload):
        return "the page's CRC-32 does not match"
    return None

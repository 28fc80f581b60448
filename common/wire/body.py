"""Request bodies at the HTTP edge: read under a size limit (Content-Length or chunked), then parse as a
JSON object whose strings are valid Unicode. Shared by the engine servers, the router and the bootstrap
registry; torch-free."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from common.wire.errors import BodyTimeout, InvalidRequest, PayloadTooLarge, UnsupportedEncoding

# A request head or body still arriving after this is cut off: a client trickling bytes holds no slot and
# no connection for long. The body's deadline is here (408); the head's is the HTTP server's (router/serve.py,
# common/edge/head_deadline.py), counted from the connection's start or its previous response.
ARRIVAL_TIMEOUT_S = 30.0


async def read_limited(
    headers: Mapping[str, str], chunks: AsyncIterator[bytes], limit: int, timeout_s: float = ARRIVAL_TIMEOUT_S
) -> bytes:
    """The body from the request's headers (lower-case names: Content-Length, absent when chunked, and
    Content-Encoding) and its chunks; UnsupportedEncoding (415) for a compressed body, PayloadTooLarge (413)
    as soon as it passes `limit` bytes, BodyTimeout (408) when it is not all there within `timeout_s`.
    Any HTTP server's request fits this."""
    check_encoding(headers.get("content-encoding"))
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_limited(headers.get("content-length"), chunks, limit)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s", param="body") from None


def check_encoding(content_encoding: str | None) -> None:
    """Bodies are read as sent: a Content-Encoding other than identity is refused (415) before any byte of
    the body is read, so a compressed or corrupt body never reaches a decompressor or the JSON parser."""
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedEncoding(
            f"Content-Encoding {content_encoding!r} is not supported: send the request body "
            "uncompressed (no Content-Encoding header, or identity)",
            param="content-encoding",
        )


async def _read_limited(content_length: str | None, chunks: AsyncIterator[bytes], limit: int) -> bytes:
    if content_length is not None:
        if not content_length.isdigit():
            raise InvalidRequest("the Content-Length header is not a number", param="content-length")
        if int(content_length) > limit:
            raise PayloadTooLarge(f"request body of {content_length} bytes exceeds the limit of {limit}", param="body")
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes", param="body")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# A JSON escape of a UTF-16 surrogate: the only way a string the tokenizer and the JSON encoder
# cannot handle (a lone surrogate) gets into a request, so only bodies with one are searched.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object whose strings are all valid Unicode, or InvalidRequest (param "body" or the field)."""
    data = load_json_object(raw)
    if SURROGATE_ESCAPE.search(raw):
        _reject_lone_surrogates(data)
    return data


def load_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object (strings may hold lone surrogates), or InvalidRequest with param "body"."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start})", param="body") from None
    except json.JSONDecodeError as e:
        raise InvalidRequest(
            f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", param="body"
        ) from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise InvalidRequest(f"request body is not acceptable JSON: {e}", param="body") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", param="body") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object", param="body")
    return data


def _reject_lone_surrogates(data: dict[str, Any]) -> None:
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _is_valid_unicode(value):
            raise InvalidRequest(
                f"{dotted_path(path) or 'body'}: contains a lone UTF-16 surrogate", param=dotted_path(path) or "body"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_valid_unicode(key):
                    raise InvalidRequest(
                        "a key of the request contains a lone UTF-16 surrogate", param=dotted_path(path) or "body"
                    )
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))


def _is_valid_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def dotted_path(path: tuple[Any, ...]) -> str:
    return ".".join(str(x) for x in path)

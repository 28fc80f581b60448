"""Read an HTTP request body under a size limit, whether the client sent Content-Length or chunks."""
from __future__ import annotations

from starlette.requests import Request

from common.errors import InvalidRequest, PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or PayloadTooLarge (413) as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("the Content-Length header is not a number", param="content-length")
        if int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}", param="body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes", param="body")
        chunks.append(chunk)
    return b"".join(chunks)

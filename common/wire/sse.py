"""Server-sent events as every Tandem HTTP server writes them: `data: <compact JSON>\n\n` per event and a
closing `data: [DONE]\n\n` (OpenAI's and SGLang's convention)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_response(stream: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

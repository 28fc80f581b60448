"""Server-sent events as every Tandem HTTP server writes them: `data: <compact JSON>\n\n` per event and a
closing `data: [DONE]\n\n` (OpenAI's and SGLang's convention)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

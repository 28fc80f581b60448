"""A mock prefill or decode worker for benchmarks/router_bench.py: answers like a Tandem server (and an
SGLang one) with fixed bodies at almost no CPU cost, so that the router between client and workers is
what a benchmark measures.

    python benchmarks/router_mock.py --role prefill|decode --port P [--events 16] [--api-key K]
        [--ssl-certfile CERT --ssl-keyfile KEY]

Plain asyncio streams and a minimal HTTP/1.1 (keep-alive, Content-Length bodies): a web framework here
would cost more CPU per request than the router under test. POST /generate, /v1/completions and
/v1/chat/completions answer JSON, or SSE when the body says `"stream": true`: the decode `--events`
token events then `data: [DONE]`, one write each; the prefill one event. GET /health, /health_generate,
/readiness, /get_server_info, /get_model_info and /v1/models answer small JSON bodies. With --api-key every
request without `Authorization: Bearer K` (/health included) is answered 401; with --ssl-certfile it speaks
HTTPS only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.wire.sse import DONE, sse_event  # noqa: E402


def generate_result(n: int, index: bool = False) -> dict:
    """The body of /generate after `n` tokens (each streamed event carries the cumulative result)."""
    ids = list(range(1000, 1000 + n))
    meta = {
        "id": "mock",
        "finish_reason": {"type": "length", "length": n} if n else None,
        "prompt_tokens": 32,
        "completion_tokens": n,
        "cached_tokens": 0,
    }
    return {"text": " tok" * n, "output_ids": ids, "meta_info": meta} | ({"index": 0} if index else {})


def chat_chunk(content: str | None, finish: str | None) -> dict:
    delta = {"content": content} if content is not None else {}
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "mock",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def chat_result(n: int) -> dict:
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 0,
        "model": "mock",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " tok" * n},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 32, "completion_tokens": n, "total_tokens": 32 + n},
    }


def bodies(tokens: int) -> dict[tuple[str, bool], list[bytes]]:
    """(path, streaming) -> the pieces of the answer body, in write order."""
    compact = lambda o: json.dumps(o, separators=(",", ":")).encode()  # noqa: E731
    gen_events = [sse_event(generate_result(i, index=True)) for i in range(1, tokens + 1)]
    chat_events = [sse_event(chat_chunk(" tok", None)) for _ in range(tokens - 1)] + [
        sse_event(chat_chunk(" tok", "length"))
    ]
    return {
        ("/generate", False): [compact(generate_result(tokens))],
        ("/generate", True): [*gen_events, DONE],
        ("/v1/chat/completions", False): [compact(chat_result(tokens))],
        ("/v1/chat/completions", True): [*chat_events, DONE],
        ("/v1/completions", False): [compact(chat_result(tokens))],
        ("/v1/completions", True): [*chat_events, DONE],
    }


GET_BODIES = {
    "/health": b"",
    "/health_generate": b"",
    "/readiness": b"{}",
    "/get_server_info": b'{"role": "mock"}',
    "/get_model_info": b'{"model_path": "mock", "is_generation": true}',
    "/v1/models": b'{"object": "list", "data": [{"id": "mock", "object": "model", "created": 0, "owned_by": "mock"}]}',
}


UNAUTHORIZED = b'{"error": {"message": "wrong key", "type": "authentication_error", "code": 401, "param": null}}'


def head(status: int, content_type: str, length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n{size}\r\n\r\n".encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class MockWorker:
    def __init__(self, role: str, tokens: int, api_key: str | None = None) -> None:
        self.answers = bodies(1 if role == "prefill" else tokens)  # a prefill makes the first token only
        self.auth = f"Bearer {api_key}" if api_key else None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self.one_request(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answers one request; False when the connection is to be closed."""
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        request_line = lines[0].split(" ")
        if len(request_line) != 3 or not request_line[2].startswith("HTTP/1."):
            return False  # e.g. an HTTP/2 preface (sglang-router probes with one): HTTP/1 only here
        method, path = request_line[:2]
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if self.auth is not None and headers.get("authorization") != self.auth:
            writer.write(head(401, "application/json", len(UNAUTHORIZED)) + UNAUTHORIZED)
        elif method == "GET" and path in GET_BODIES:
            writer.write(head(200, "application/json", len(GET_BODIES[path])) + GET_BODIES[path])
        elif method == "POST" and (path, False) in self.answers:
            await self.generate(writer, path, json.loads(body).get("stream") is True)
        else:
            writer.write(head(404, "application/json", 2) + b"{}")
        return headers.get("connection", "").lower() != "close"

    async def generate(self, writer: asyncio.StreamWriter, path: str, stream: bool) -> None:
        pieces = self.answers[path, stream]
        if not stream:
            writer.write(head(200, "application/json", len(pieces[0])) + pieces[0])
            return
        writer.write(head(200, "text/event-stream", None))
        for piece in pieces:
            writer.write(chunk(piece))
            await asyncio.sleep(0)  # one event per loop turn, as a server that emits a token per step
        writer.write(b"0\r\n\r\n")


async def main(a: argparse.Namespace) -> None:
    tls = None
    if a.ssl_certfile:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(a.ssl_certfile, a.ssl_keyfile)
    worker = MockWorker(a.role, a.events, a.api_key)
    server = await asyncio.start_server(worker.serve, "127.0.0.1", a.port, backlog=1024, ssl=tls)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events", type=int, default=16, help="token events of a streamed decode answer")
    p.add_argument("--api-key", help="answer 401 to requests without it")
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")
    asyncio.run(main(p.parse_args()))

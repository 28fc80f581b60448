"""An endpoint under test: its URL and dialect (--backend), the model name it serves, and whether it
takes prompts as token ids, found out before a run."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.bench.workload import BenchRequest

PATHS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "sglang": "/generate"}


@dataclass
class Endpoint:
    """A server under test and how to talk to it."""

    base_url: str
    backend: str
    model: str | None
    token_ids: bool  # send prompts as token ids (exact lengths) rather than text
    ignore_eos: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    label: str | None = None  # its name in the table, the JSON and the plots [default: base_url]

    @property
    def name(self) -> str:
        return self.label or self.base_url

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + PATHS[self.backend]

    def body(self, req: BenchRequest, stream: bool = True) -> dict[str, Any]:
        """The request body for `req` in this backend's dialect."""
        if self.backend == "sglang":  # SGLang's /generate takes token ids
            params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": self.ignore_eos}
            return {"input_ids": req.prompt_ids, "sampling_params": params, "stream": stream} | self.extra
        body: dict[str, Any] = {"max_tokens": req.output_len, "temperature": 0.0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.model is not None:
            body["model"] = self.model
        if self.backend == "openai-chat":
            body["messages"] = [{"role": "user", "content": req.text}]
        else:
            body["prompt"] = req.prompt_ids if self.token_ids else req.text
        return body | self.extra


async def connect(session: aiohttp.ClientSession, endpoint: Endpoint, probe: BenchRequest) -> Endpoint:
    """`endpoint` with its model name filled in (unless given) and, for /v1/completions, token-id
    prompts kept only if the server accepts them (OpenAI's own API takes text only)."""
    try:
        if endpoint.model is None:
            endpoint = dataclasses.replace(endpoint, model=await _served_model(session, endpoint.base_url))
        if endpoint.backend == "openai" and endpoint.token_ids:
            short = dataclasses.replace(probe, output_len=1)
            async with session.post(endpoint.url, json=endpoint.body(short, stream=False)) as r:
                if r.status in (400, 422):
                    print(
                        f"{endpoint.base_url} rejects token-id prompts (HTTP {r.status}); sending text, so prompt "
                        "lengths are the server's count of the decoded text"
                    )
                    return dataclasses.replace(endpoint, token_ids=False)
                await _raise_unless_ok(r, endpoint.url)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise SystemExit(
            f"{endpoint.base_url}: cannot connect ({type(e).__name__}: {e}); start the server or pass "
            "the right --base-url"
        ) from None
    return endpoint


async def _served_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The first model of GET /v1/models; None when the server has no such route (SGLang /generate only)."""
    url = base_url.rstrip("/") + "/v1/models"
    async with session.get(url) as r:
        if r.status == 404:
            return None
        await _raise_unless_ok(r, url)
        models = (await r.json()).get("data") or []
    return models[0]["id"] if models else None


async def _raise_unless_ok(r: aiohttp.ClientResponse, url: str) -> None:
    if r.status == 200:
        return
    hint = "pass --api-key (or set OPENAI_API_KEY)" if r.status == 401 else "check --base-url, --backend and --model"
    raise SystemExit(f"{url}: HTTP {r.status}: {(await r.text())[:300]}; {hint}")

"""`POST /load_lora_adapter` and `/unload_lora_adapter` (and vLLM's /v1/ spellings) on the router: the body goes
unchanged to every worker, prefill and decode (a request's adapter must be on both halves of its pair), at once.
All answered 200: the router answers 200 with each worker's answer. Otherwise it answers the highest status a
worker answered (502 for one it could not reach), an error naming each worker that failed and why, and the
same per-worker list, so an operator sees which workers hold the adapter now. Each worker's /v1/models follows
its own load, and the router re-reads them at once (not at its next health round), so its adapter-aware
routing (router/adapters.py) sends the next request under a loaded adapter to the workers that now hold it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from common.wire.body import read_limited
from common.wire.errors import error_body
from router.dispatch import json_response
from router.workers import Worker, WorkerRegistry

PATHS = ("/load_lora_adapter", "/unload_lora_adapter")
CALL_TIMEOUT_S = 120.0  # reading an adapter from disk on a worker


def add_lora_fanout_routes(app: web.Application, workers: WorkerRegistry, max_bytes: int) -> None:
    async def fan_out(request: web.Request) -> web.Response:
        body = await read_limited(request.headers, request.content.iter_any(), max_bytes)
        path = "/" + request.path.rsplit("/", 1)[-1]
        targets = list(workers.workers.values())
        answers = await asyncio.gather(*(_call(app["session"], w, path, body) for w in targets))
        if workers.read_models:
            await asyncio.gather(*(workers.learn_models(app["session"], w) for w in targets if w.healthy))
        return _answer(path, answers)

    for path in PATHS:
        app.router.add_post(path, fan_out)
        app.router.add_post("/v1" + path, fan_out)


async def _call(session: aiohttp.ClientSession, worker: Worker, path: str, body: bytes) -> dict:
    """One worker's answer: its url, role, status and JSON body (502 and the cause when it could not answer)."""
    where = {"url": worker.url, "role": worker.role}
    try:
        async with session.post(
            worker.url + path,
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S),
            server_hostname=worker.tls_name,
        ) as r:
            raw = await r.read()
            status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return where | {"status": 502, "answer": error_body(f"{worker.url}{path} failed: {e!r}", "upstream_error", 502)}
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = {"raw": raw.decode(errors="replace")[:500]}
    return where | {"status": status, "answer": answer}


def _answer(path: str, answers: list[dict]) -> web.Response:
    failed = [a for a in answers if a["status"] != 200]
    if not answers:
        return json_response(error_body(f"{path}: the router has no workers", "overloaded_error", 503), 503)
    if not failed:
        return json_response({"success": True, "error_message": None, "workers": answers})
    status = max(a["status"] for a in failed)
    causes = "; ".join(f"{a['role']} {a['url']}: {a['status']} {_message(a['answer'])}" for a in failed)
    body = error_body(f"{path} failed on {len(failed)} of {len(answers)} workers: {causes}", _type(status), status)
    return json_response(body | {"workers": answers}, status)


def _message(answer: dict) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    return error.get("message", "") if isinstance(error, dict) else str(answer)[:200]


def _type(status: int) -> str:
    return {404: "not_found_error", 400: "invalid_request_error"}.get(status, "upstream_error")

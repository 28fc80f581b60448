"""The router's answers for the cluster behind it, as sglang-router gives them:

GET /get_server_info   the router's config and each worker's own /get_server_info, as
                       {"role": "router", "config": {...}, "prefill": [...], "decode": [...]}; every entry
                       has the worker's url, and one that did not answer has an "error" instead of its info
GET /health_generate   one real 1-token generation through a healthy (prefill, decode) pair, on the path a
                       client's request takes: 200, or 503 naming what failed
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from common.wire.errors import error_body
from router.config import SECRET_FIELDS, RouterConfig
from router.dispatch import Dispatcher, json_response
from router.workers import Worker, WorkerRegistry

INFO_TIMEOUT_S = 5.0
# the probe's request, as a client would send it to /generate (a token id every vocabulary has)
PROBE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
PROBE_RAW = json.dumps(PROBE).encode()


async def server_info(config: RouterConfig, workers: WorkerRegistry, session: aiohttp.ClientSession) -> dict[str, Any]:
    """The router's config (no key) and every worker's info, grouped by role; asked all at once."""
    known = list(workers.workers.values())
    infos = await asyncio.gather(*(worker_info(session, w) for w in known))
    groups: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for w, info in zip(known, infos):
        groups[w.role].append(info)
    return {"role": "router", "config": config.model_dump(exclude=SECRET_FIELDS), **groups}


async def worker_info(session: aiohttp.ClientSession, worker: Worker) -> dict[str, Any]:
    """{"url", ...the worker's /get_server_info}, or {"url", "error"} saying why there is none."""
    try:
        async with session.get(
            worker.url + "/get_server_info",
            timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S),
            server_hostname=worker.tls_name,
        ) as r:
            raw = await r.read()
        info = json.loads(raw) if r.status == 200 else None
        if isinstance(info, dict):
            return {"url": worker.url, **info}
        error = f"GET /get_server_info answered HTTP {r.status}: {raw[:200].decode(errors='replace')}"
    except asyncio.TimeoutError:
        error = f"GET /get_server_info timed out after {INFO_TIMEOUT_S:g} s"
    except aiohttp.ClientError as e:
        error = f"GET /get_server_info failed: {type(e).__name__}: {e}"
    except ValueError:
        error = "GET /get_server_info answered a body that is not JSON"
    return {"url": worker.url, "error": error}


async def health_generate(dispatcher: Dispatcher, request: web.Request) -> web.Response:
    """200 once PROBE came back from a pair; 503 with the failure's own message otherwise. The probe is a
    /generate request for the router's metrics and log, as it is for the workers."""
    answer = await dispatcher.dispatch("/generate", request, PROBE_RAW, dict(PROBE), time.monotonic())
    if answer.status == 200:
        return web.Response()
    cause = json.loads(answer.body)["error"]["message"]
    message = f"a 1-token generation through a prefill and decode pair failed with HTTP {answer.status}: {cause}"
    return json_response(error_body(message, "unhealthy", 503), 503)

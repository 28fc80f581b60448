"""`POST /pd_role_switch {"url": WORKER, "new_role": "prefill" | "decode"}` on the router (SGLang's mini_lb has
the same endpoint): the worker leaves rotation at once (its requests in flight run on), is asked to switch
(common/engine/role_switch.py: it finishes them first), and joins the rotation of its new role once its /health
says so. The worker's own answer is the router's. Every router process follows a switch through the workers'
/health headers (router/workers.py `follow`), whoever asked for it, and through a switched worker's refusal of a
request meant for its old role (common/http/role_guard.py); the planner (planner/) asks here.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from common.wire.body import parse_json_object, read_limited
from common.wire.errors import InvalidRequest, error_body
from router.workers import WorkerRegistry

log = logging.getLogger("tandem.router")
SWITCH_MARGIN_S = 30.0  # beyond the worker's own wait for its requests


def add_pd_role_switch_route(app: web.Application, workers: WorkerRegistry, max_bytes: int, timeout_s: float) -> None:
    """`timeout_s`: how long the router waits for a worker's switch (its --pd-role-switch-timeout-s and more)."""

    async def pd_role_switch(request: web.Request) -> web.Response:
        body = parse_json_object(await read_limited(request.headers, request.content.iter_any(), max_bytes))
        url, new_role = body.get("url"), body.get("new_role")
        worker = workers.workers.get(url.rstrip("/")) if isinstance(url, str) else None
        if worker is None:
            raise InvalidRequest(f"url: {url!r} is not a worker of this router (GET /workers lists them)", param="url")
        if new_role not in ("prefill", "decode"):
            raise InvalidRequest("new_role: give prefill or decode", param="new_role")
        workers.set_draining(worker)  # no new request goes to it; what runs on it runs on
        session: aiohttp.ClientSession = request.app["session"]
        log.info("asking %s worker %s to switch to %s", worker.role, worker.url, new_role)
        try:
            async with session.post(
                worker.url + "/pd_role_switch",
                json={"new_role": new_role},
                timeout=aiohttp.ClientTimeout(total=timeout_s + SWITCH_MARGIN_S),
                server_hostname=worker.tls_name,
            ) as r:
                status, answer = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            status, answer = (
                502,
                json.dumps(error_body(f"{worker.url}/pd_role_switch failed: {e!r}", "upstream_error", 502)).encode(),
            )
        await workers.check(session, worker)  # back in rotation, in its new role, if it serves
        return web.Response(body=answer, status=status, content_type="application/json")

    app.router.add_post("/pd_role_switch", pd_role_switch)

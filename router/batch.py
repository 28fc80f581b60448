"""A batched request through the router (common/wire/batch.py splits it): one PD request per prompt, all at once
and maybe on different pairs, merged in order (choices prompt_i * n + j, usage summed; /generate's answers one
list). The first part that fails ends the batch with its error, naming the prompt; the others are aborted, as
they are when the client goes away (cancelled, each part closes its pair's calls)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from common.wire.batch import COMPLETIONS, listed_fields, part_error, summed_usage
from common.wire.errors import error_body
from router.request_hints import RequestHints

if TYPE_CHECKING:
    from router.dispatch import Dispatcher

COMPACT = json.JSONEncoder(separators=(",", ":"))


async def dispatch_batch(
    dispatcher: Dispatcher,
    path: str,
    request: web.Request,
    body: dict[str, Any],
    parts: list[dict[str, Any]],
    start: float,
    hints: RequestHints,
) -> web.StreamResponse:
    """Every part through its own pair (each admitted as a request of its own), then the merged answer."""
    tasks = [
        asyncio.ensure_future(dispatcher.dispatch(path, request, COMPACT.encode(p).encode(), p, start, hints))
        for p in parts
    ]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in tasks if t in done and t.result().status != 200]
            if failed:
                return _part_failure(path, body, tasks.index(failed[0]), failed[0].result())
        answers = [json.loads(t.result().body) for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return web.json_response(_completions(answers) if path == COMPLETIONS else _generate(answers))


def _part_failure(path: str, body: dict[str, Any], index: int, response: web.Response) -> web.Response:
    """The batch's answer when prompt `index` failed: its error, a 400 naming the client's field."""
    try:
        error = json.loads(response.body)["error"]
        message, param = part_error(error["message"], error.get("param"), index, listed_fields(path, body))
    except (ValueError, KeyError, TypeError):
        return response
    retry = response.headers.get("Retry-After")
    body = error_body(message, error.get("type", "invalid_request_error"), response.status, param)
    return web.json_response(body, status=response.status, headers={"Retry-After": retry} if retry else None)


def _completions(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The first answer's id and fields, every prompt's choices renumbered in order, usage summed."""
    choices, offset = [], 0
    for answer in answers:
        choices += [c | {"index": offset + c["index"]} for c in answer["choices"]]
        offset += len(answer["choices"])
    return answers[0] | {"choices": choices, "usage": summed_usage([a["usage"] for a in answers])}


def _generate(answers: list[Any]) -> list[Any]:
    """/generate's batch answer: each prompt's result (a list of them with n > 1), one list."""
    return [r for answer in answers for r in (answer if isinstance(answer, list) else [answer])]

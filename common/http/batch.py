"""A batched request on the server (common/wire/batch.py splits it): each prompt's part is checked as a request of
its own, the failure of one a 400 naming its index before any runs; the parts then run at once (so they batch)
and their answers merge in order."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from common.core.request import GenInput
from common.engine.engine import Engine
from common.http.serving import Choice, merged
from common.wire.batch import listed_fields, part_error
from common.wire.errors import InvalidRequest, Overloaded
from common.wire.sse import DONE

P = TypeVar("P")


@dataclass
class Part(Generic[P]):
    """One prompt of a batch: its place, what was built of its body (`built`), its choices' first index in the
    answer (`offset`: prompt_i * n), and its choices once they ran."""

    index: int
    built: P
    gen: GenInput
    offset: int = 0
    choices: list[Choice] = field(default_factory=list)


async def build_parts(
    engine: Engine,
    path: str,
    data: dict[str, Any],
    bodies: list[dict[str, Any]],
    build: Callable[[dict[str, Any]], Awaitable[tuple[P, GenInput]]],
) -> list[Part[P]]:
    """Each part's (built, GenInput) by `build` from its body, every one checked before any runs; the batch needs
    room in the queue for all its requests. A pair's half serves one prompt: the router splits a batch."""
    if data.get("bootstrap_room") is not None or data.get("migration") is not None:
        raise InvalidRequest("a PD request has one prompt: the router splits a list of prompts", param="bootstrap_room")
    listed, parts, offset = listed_fields(path, data), [], 0
    for i, body in enumerate(bodies):
        try:
            built, gen = await build(body)
        except InvalidRequest as e:
            message, param = part_error(e.message, e.param, i, listed)
            raise InvalidRequest(message, param=param) from None
        parts.append(Part(i, built, gen, offset))
        offset += gen.params.n
    _check_room(engine, offset)
    return parts


def _check_room(engine: Engine, requests: int) -> None:
    queued, limit = engine.scheduler.num_queued(), engine.config.max_queued_requests
    if queued + requests > limit:
        raise Overloaded(f"server is full: {queued} requests queued, this batch has {requests} (limit {limit})")


async def merged_streams(streams: list[AsyncIterator[bytes]], tail: Callable[[], bytes]) -> AsyncIterator[bytes]:
    """The parts' event streams as one, events as they come, then `tail()` (e.g. the summed usage) and [DONE]."""
    async for _, event in merged(streams):
        yield event
    yield tail() + DONE

"""From a validated API request to engine requests and back: tokenize, check limits, fan out `n`,
merge the event streams, and accumulate one result per choice."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from common.config import ServerConfig
from common.core.request import FinishReason, GenInput, OutputEvent, Req
from common.engine.engine import Engine
from common.wire.api import rendezvous_problem
from common.wire.errors import InvalidRequest, Overloaded, RequestAborted, error_for_status
from common.wire.migration import ResumedChoice, trace

if TYPE_CHECKING:
    from common.engine.grammar.backend import GrammarBackend

T = TypeVar("T")


@dataclass
class Choice:
    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    finish: FinishReason | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resumed(cls, index: int, shown: ResumedChoice | None) -> Choice:
        """Choice `index` as a migrated request's client has it already (common/wire/migration.py)."""
        if shown is None:
            return cls(index)
        logprobs, tops = shown.logprobs()
        return cls(index, shown.text or "", list(shown.output_ids), logprobs, tops)

    def add(self, ev: OutputEvent) -> None:
        self.text += ev.text
        self.output_ids += ev.token_ids
        self.logprobs += ev.logprobs
        self.top_logprobs += ev.top_logprobs
        if ev.meta:  # the first token's event has the prompt's logprobs, the last one the counts too
            self.meta = self.meta | ev.meta
        if ev.finish is not None:
            self.finish = ev.finish


PD_CACHED = ("prefill_cached_tokens", "decode_cached_tokens")  # a decode's meta: what each side's cache reused
SPEC_COUNTS = ("spec_verify_ct", "spec_accepted_tokens")  # a speculative server's: verifies, drafts they kept


def new_rid(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


def tokenize_text(tokenizer: Any, text: str, param: str) -> list[int]:
    if not text:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    return tokenizer.encode(text)


def check_input(engine: Engine, gen: GenInput, param: str, max_tokens_param: str) -> None:
    """What the engine would refuse, as a 400 naming the field before anything is scheduled (and a full
    queue as a 503). `param` names the prompt, `max_tokens_param` the maximum of new tokens; the other
    sampling fields sit beside it (`sampling_params.*` for /generate)."""
    check_rendezvous(engine.mode, gen)
    queued = engine.scheduler.num_queued()
    if queued + gen.params.n > engine.config.max_queued_requests:
        raise Overloaded(
            f"server is full: {queued} requests queued (limit {engine.config.max_queued_requests}); retry later"
        )
    vocab = engine.hf_config.vocab_size
    _check_prompt(gen, vocab, engine.context_len, param, max_tokens_param)
    _check_resume(gen, vocab)
    check_token_ids(list(gen.params.logit_bias or ()), vocab, _sibling(max_tokens_param, "logit_bias"))
    check_token_ids(gen.params.stop_token_ids or [], vocab, _sibling(max_tokens_param, "stop_token_ids"))


async def check_grammar(grammar: GrammarBackend | None, gen: GenInput) -> None:
    """A 400 naming the field unless the request's grammar compiles here, before anything is scheduled (its
    compilation then goes on off the scheduler thread, which the request waits for in its own queue)."""
    spec = gen.grammar_spec
    if spec is None:
        return
    if grammar is None:
        raise InvalidRequest(
            f"{spec.param}: constrained decoding is off on this server (--grammar-backend none)", param=spec.param
        )
    await grammar.check(spec)


def _check_prompt(gen: GenInput, vocab: int, context_len: int, param: str, max_tokens_param: str) -> None:
    """The prompt's ids (of a vocabulary of `vocab`), its length and what must fit beside it in the context."""
    n = len(gen.prompt_ids)
    if n == 0:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if min(gen.prompt_ids) < 0 or max(gen.prompt_ids) >= vocab:
        raise InvalidRequest(f"{param}: token ids must be in [0, {vocab})", param=param)
    if n >= context_len:
        raise InvalidRequest(f"{param} has {n} tokens; this server's context length is {context_len}", param=param)
    if n + gen.params.max_new_tokens > context_len:
        raise InvalidRequest(
            f"{max_tokens_param}: {n} prompt tokens + {gen.params.max_new_tokens} new tokens exceed the context "
            f"length {context_len}; ask for at most {context_len - n}",
            param=max_tokens_param,
        )
    if gen.logprob_start_len >= n:
        raise InvalidRequest(
            f"logprob_start_len ({gen.logprob_start_len}) must be less than the prompt's length ({n})",
            param="logprob_start_len",
        )


def _check_resume(gen: GenInput, vocab: int) -> None:
    """A migrated request's choices as its client has them: one per choice, tokens of the vocabulary, fewer
    than the maximum unless the choice has ended."""
    resume = gen.migration.resume if gen.migration else None
    if resume is None:
        return
    if len(resume) != gen.params.n:
        raise InvalidRequest(f"migration.resume has {len(resume)} choices, n is {gen.params.n}", param="migration")
    for shown in filter(None, resume):
        check_token_ids(shown.output_ids, vocab, "migration.resume.output_ids")
        if not shown.finished and len(shown.output_ids) >= gen.params.max_new_tokens:
            raise InvalidRequest(
                "migration.resume: a choice that has not ended has fewer tokens than the maximum", param="migration"
            )


def check_priority(config: ServerConfig, priority: int | None) -> int:
    """A request's priority (0 when absent); giving one needs --enable-priority-scheduling, as in SGLang."""
    if priority is not None and not config.enable_priority_scheduling:
        raise InvalidRequest(
            "priority is not accepted: this server was started without --enable-priority-scheduling", param="priority"
        )
    return priority or 0


def check_dp_rank(dp_size: int, rank: int | None) -> int | None:
    """The DP rank a request asks for (SGLang's data_parallel_rank), which this server (of `dp_size`) must have."""
    if rank is not None and rank >= dp_size:
        raise InvalidRequest(
            f"data_parallel_rank {rank}: this server has {dp_size} DP rank(s) (--dp-size with --enable-dp-attention)",
            param="data_parallel_rank",
        )
    return rank


def check_rendezvous(mode: str, gen: GenInput) -> None:
    """A prefill or decode server (`mode`, the role it serves now) serves only what a router paired (it added the
    bootstrap fields), or what a decode is asked to prefill itself (pd_placement local)."""
    problem = rendezvous_problem(mode, gen.rendezvous, gen.pd_placement)
    if problem is not None:
        raise InvalidRequest(problem, param="pd_placement" if gen.pd_placement == "local" else "bootstrap_room")


def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    """Token ids the sampler indexes its logits with must be in the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)


def _sibling(path: str, name: str) -> str:
    """`name` beside the last field of a dotted path: ("sampling_params.max_new_tokens", "x") -> "sampling_params.x"."""
    head, dot, _ = path.rpartition(".")
    return head + dot + name


def make_reqs(gen: GenInput) -> list[tuple[int, Req]]:
    """(choice index, Req) of each choice still to generate. Every request draws its random numbers from a
    stream of its own (common/engine/sampler.py): the client's seed, else the router's (`migration.seed`, so
    that a request moved to another pair draws what it would have), else a fresh one; choice i of n > 1 uses
    seed + i. A migrated choice starts from the tokens its client was shown (`migration.resume`)."""
    base = gen.params.seed
    if base is None:
        base = gen.migration.seed if gen.migration is not None else random.getrandbits(63)
    resume = gen.migration.resume if gen.migration is not None else None
    reqs = []
    for i in range(gen.params.n):
        shown = resume[i] if resume is not None else None
        if shown is not None and shown.finished:
            continue
        params = gen.params.model_copy(update={"seed": base + i if gen.params.n > 1 else base})
        choice = replace(
            gen,
            rid=gen.rid if params.n == 1 else f"{gen.rid}-{i}",
            params=params,
            rendezvous=gen.rendezvous.for_choice(i) if gen.rendezvous else None,
        )
        req = Req(**{f.name: getattr(choice, f.name) for f in fields(GenInput)})
        if shown is not None:  # its client has the prompt's logprobs (the router keeps them) and these tokens
            req.prompt_ids, req.resumed_len = gen.prompt_ids + shown.output_ids, len(shown.output_ids)
            req.logprob_start_len = -1
        reqs.append((i, req))
    return reqs


def initial_choices(gen: GenInput) -> list[Choice]:
    """Every choice of `gen` as its client has it before this server's first event: empty, or as an earlier
    server left it (a migrated request)."""
    resume = gen.migration.resume if gen.migration is not None else None
    return [Choice.resumed(i, resume[i] if resume else None) for i in range(gen.params.n)]


async def stream_choices(engine: Engine, gen: GenInput, stream: bool = True) -> AsyncIterator[tuple[int, OutputEvent]]:
    """Run the requests of `gen`'s choices concurrently; yield (choice index, event) as they come (with `stream`
    False, each request's events once it ended)."""
    reqs = make_reqs(gen)
    async for k, ev in merged([engine.generate(req, stream) for _, req in reqs]):
        yield reqs[k][0], ev


async def merged(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(k, item) of the k-th iterator's items, all iterated at once, as they come; ended early, every one is
    closed (an engine request's generator aborts its request)."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | None, bool]] = asyncio.Queue()

    async def pump(k: int, it: AsyncIterator[T]) -> None:
        async for item in it:
            await queue.put((k, item, False))
        await queue.put((k, None, True))

    tasks = [asyncio.create_task(pump(k, it)) for k, it in enumerate(iterators)]
    try:
        done = 0
        while done < len(tasks):
            k, item, ended = await queue.get()
            if ended:
                done += 1
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(engine: Engine, gen: GenInput, request: Any = None) -> list[Choice]:
    """All choices of `gen`; when the HTTP client goes away first, the requests are aborted."""
    return (await collect_all(engine, [gen], request))[0]


async def collect_all(engine: Engine, gens: list[GenInput], request: Any = None) -> list[list[Choice]]:
    """All choices of each of `gens` (the prompts of a batch), run at once; when the HTTP client goes away
    first, or one of them fails, every request is aborted."""
    task = asyncio.ensure_future(_collect_all(engine, gens))
    while request is not None:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            break
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise RequestAborted("client disconnected before the response was ready")
    return await task


async def _collect_all(engine: Engine, gens: list[GenInput]) -> list[list[Choice]]:
    tasks = [asyncio.ensure_future(_collect(engine, g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(engine: Engine, gen: GenInput) -> list[Choice]:
    choices = initial_choices(gen)
    async for i, ev in stream_choices(engine, gen, stream=False):
        choices[i].add(ev)
    for c in choices:
        raise_if_failed(c.finish)
    return choices


def raise_if_failed(finish: FinishReason | None) -> None:
    """A request the engine ended early (abort) as the error its status says (common/wire/errors.py)."""
    if finish is not None and finish.type == "abort":
        raise error_for_status(finish.message or "request aborted", finish.status or 500)


def usage(choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(len(c.output_ids) for c in choices)
    details = {"cached_tokens": max((c.meta.get("cached_tokens", 0) for c in choices), default=0)}
    for key in PD_CACHED:
        if any(key in c.meta for c in choices):
            details[key] = max(c.meta.get(key, 0) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": details,
    }


def created(gen: GenInput | None = None) -> int:
    """The answer's creation time: a migrated request's first server's (the router passes it on)."""
    return gen.migration.created if gen is not None and gen.migration is not None else int(time.time())


class Tracer:
    """The token trace of a stream the router may move (common/wire/migration.py); nothing without `migration`."""

    def __init__(self, gen: GenInput):
        self.on = gen.migration is not None
        resume = gen.migration.resume if self.on else None
        self.shown = {i for i, c in enumerate(resume or ()) if c is not None}  # choices the client saw before
        self.traced: set[int] = set()
        self.prompt_len = len(gen.prompt_ids)

    def seen(self, i: int) -> bool:
        """Whether choice `i`'s client saw anything of it on an earlier server (no role event, no echo again)."""
        return i in self.shown

    def line(self, i: int, ids: list[int] = (), finished: bool = False) -> bytes:
        """The trace line of choice `i`'s next event (b"" when off)."""
        if not self.on:
            return b""
        first = i not in self.traced
        self.traced.add(i)
        return trace(i, list(ids), self.prompt_len if first else None, finished)

    def alone(self, i: int, ev: OutputEvent) -> bytes:
        """An event of its own for tokens that show nothing yet."""
        return self.line(i, ev.token_ids) + b"\n"

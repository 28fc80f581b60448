"""xgrammar behind one object: parse a GrammarSpec (what the HTTP layer checks before scheduling), compile
it on a thread of its own into an LRU cache of futures keyed by the spec, and build each request's state.

    HTTP handler ── check(spec): parse on a worker thread; a grammar that does not parse is a 400 ─┐
                                   and its compilation starts (compiled(spec))                      │
    scheduler thread ── attach(req): ReqGrammar with the cached future; a request whose future is   │
                        not done waits in Scheduler's grammar queue, never the step itself  ◀──────┘

Parsing (schema -> EBNF, regex -> EBNF) is fast; compiling builds the per-token mask cache over the
vocabulary (milliseconds to seconds for a large schema), which is why it runs off the scheduler thread.
The compiler itself (xgrammar's table of the vocabulary's tokens) is built by the first compilation, as
vLLM builds its backend on the first structured request: a server that is never asked for structure never
pays for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from common.core.request import Req
from common.engine.grammar.req_grammar import ReqGrammar
from common.wire.errors import InvalidRequest
from common.wire.structured_output import GrammarSpec

log = logging.getLogger(__name__)
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error without its C++ source location."""
    return _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))


class GrammarBackend:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_ids: set[int],
        cache_size: int = 512,
        any_whitespace=True,
        max_whitespace: int | None = None,
    ):
        self._tokenizer, self._stop_ids = tokenizer, sorted(stop_ids)
        self.vocab_size = vocab_size
        self.compiler: xgr.GrammarCompiler | None = None  # the first compile builds it (as vLLM's first request)
        self.any_whitespace = any_whitespace
        self.max_whitespace = max_whitespace if any_whitespace else None
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.compiles = self.hits = 0

    # -- any thread ----------------------------------------------------------------------------
    def parse(self, spec: GrammarSpec) -> xgr.Grammar:
        """The spec as an xgrammar Grammar, or InvalidRequest naming its field."""
        try:
            return self._parse(spec)
        except Exception as e:
            what = {"json_schema": "the JSON schema", "regex": "the regex", "ebnf": "the EBNF grammar"}
            raise InvalidRequest(
                f"{spec.param}: {what.get(spec.kind, 'the ' + spec.kind)} does not compile: {xgrammar_message(e)}",
                param=spec.param,
            ) from None

    def _parse(self, spec: GrammarSpec) -> xgr.Grammar:
        kind, value = spec.kind, spec.value
        if kind in ("json_schema", "json_object"):  # json_object: any object, as SGLang reads it
            schema, strict = (value, True) if kind == "json_schema" else ({"type": "object"}, False)  # GrammarSpec
            return xgr.Grammar.from_json_schema(
                schema, any_whitespace=self.any_whitespace, strict_mode=strict, max_whitespace_cnt=self.max_whitespace
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(value))
            )
        return _structural_tag_grammar(json.loads(value))

    def compiled(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of `spec` (a Future: done at once when cached)."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            self.compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if self.compiler is None:  # only the compile thread gets here
            self.compiler = self._make_compiler()
        return self.compiler.compile_grammar(self.parse(spec))

    def _make_compiler(self) -> xgr.GrammarCompiler:
        """xgrammar's compiler over this vocabulary: its token table costs about 0.5 s for 49k tokens, paid by
        the first constrained request (on this thread, never the scheduler's) rather than by every start."""
        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
        )
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    async def check(self, spec: GrammarSpec) -> None:
        """A 400 naming the field unless `spec` parses; its compilation starts meanwhile (HTTP side)."""
        await asyncio.to_thread(self.parse, spec)
        self.compiled(spec)

    # -- scheduler thread ----------------------------------------------------------------------
    def attach(self, req: Req, reasoning_end: str | None, decode) -> None:
        """Give `req` its own grammar state (a matcher per choice), bound to the cached compilation."""
        spec = req.grammar_spec
        gate = reasoning_end if spec.after_reasoning else None
        prompt = req.prompt_ids[: len(req.prompt_ids) - req.resumed_len]  # a migrated request's shown tokens are output
        if gate is not None and _thinking_closed(decode(prompt[-16:]), gate):
            gate = None  # the chat template closed the thinking itself (e.g. enable_thinking false)
        req.grammar = ReqGrammar(spec, self.compiled(spec), gate, decode, self.vocab_size)
        req.grammar.resume(req.resumed_ids)

    def info_dict(self) -> dict:
        return {"backend": "xgrammar", "cached": len(self._cache), "compiles": self.compiles, "cache_hits": self.hits}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _thinking_closed(prompt_tail: str, end: str) -> bool:
    return prompt_tail.rstrip().endswith(end)


def _structural_tag_grammar(tag: dict) -> xgr.Grammar:
    """SGLang's {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers"} or xgrammar's format."""
    if "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag["triggers"])
    return xgr.Grammar.from_structural_tag(tag)

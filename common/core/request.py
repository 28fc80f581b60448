"""The one object that carries a request through the scheduler, the pools and the output stream."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.core.timeline import Timeline
from common.wire.api import Rendezvous
from common.wire.migration import Migration
from common.wire.sampling_params import SamplingParams
from common.wire.structured_output import GrammarSpec

if TYPE_CHECKING:
    from common.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
    from common.engine.grammar.req_grammar import ReqGrammar


LORA_KEY_STRIDE = 1 << 32  # an adapter's cache keys: its tokens shifted past every token id (Req.cache_key)


def key_lora_id(keys: list[int]) -> int:
    """The adapter namespace (lora_id, 0: the base model) of a run of cache keys (Req.cache_key's, one namespace)."""
    return keys[0] // LORA_KEY_STRIDE if keys else 0


def key_token_ids(keys: list[int]) -> list[int]:
    """The token ids of a run of cache keys, their adapter's offset taken off."""
    offset = key_lora_id(keys) * LORA_KEY_STRIDE
    return [k - offset for k in keys] if offset else keys


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued for prefill (also after retraction)
    PAIRING = "pairing"  # decode: waiting to reserve pages and reach the prefill, before any compute
    TRANSFERRING = "transferring"  # PD: KV is moving between prefill and decode
    RUNNING = "running"  # prefilled; in the decode batch
    FINISHED = "finished"


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None
    status: int | None = None  # HTTP status for aborts caused by a fault

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message:
            out["message"] = self.message
        return out


@dataclass
class OutputEvent:
    """New output of one request since its last event; `finish` is set on the last one."""

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish: FinishReason | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class GenInput:
    """What a client asked for: the HTTP layer builds one per API request (all `n` choices), and each
    choice's Req starts from the same fields (common/http/serving.py make_reqs)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: also return logprobs of prompt tokens after this index
    rendezvous: Rendezvous | None = None  # PD: how to find the peer and the room shared with it
    pd_placement: str | None = (
        None  # PD: where the prompt is computed (common/wire/api.py PLACEMENTS; None: remote_suffix)
    )
    priority: int = 0  # higher first: admitted before, retracted after (--enable-priority-scheduling)
    migration: Migration | None = None  # the router may move it to another pair (common/wire/migration.py)
    data_parallel_rank: int | None = None  # the DP rank asked for (SGLang's field; DP attention), else balanced
    grammar_spec: GrammarSpec | None = None  # what the output must match (json_schema, regex, tool_choice...)
    lora: str | None = None  # the LoRA adapter it runs under (--lora-paths' name), None: the base model
    lora_id: int = 0  # that adapter's prefix-cache namespace (common/lora/manager.py), 0: the base model's


@dataclass(eq=False)  # identity, not field equality: two requests may carry the same rid and prompt
class Req(GenInput):
    """One choice of a client's request as the scheduler, the pools and the output stream carry it."""

    sink: Callable[[OutputEvent], None] | None = None
    # a migrated request: the last resumed_len tokens of prompt_ids are output that an earlier server showed the
    # client; they count as output (sampling position, penalties, token limits, usage) and are never shown again
    resumed_len: int = 0

    status: ReqStatus = ReqStatus.WAITING
    dp_rank: int | None = None  # the DP rank whose scheduler, pool and batch run it (DP attention), chosen once
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)  # per prompt token; None for the first
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)  # when top_logprobs_num
    finish: FinishReason | None = None

    # memory: tokens [0, cached_len) sit in locked radix-tree pages, [cached_len, kv_len) in pages this
    # request owns; req_to_token[req_pool_idx, :kv_len] holds their KV slots, of which the first
    # kv_computed_len hold KV a forward (or a transfer) wrote, of the target and of a draft model if the server
    # runs one (common/engine/spec/): only those may enter the prefix cache.
    req_pool_idx: int | None = None
    kv_len: int = 0
    cached_len: int = 0
    kv_computed_len: int = 0
    last_node: Any = None  # the prefix cache's node locked for [0, cached_len)
    prefix_hit_len: int = 0  # cached tokens reused at the first prefill, reported to the client
    decode_hit_len: int | None = None  # a decode server's: prompt tokens its own prefix cache had (not sent)
    store_hit_len: int = 0  # prompt tokens read from the KV store for it (--hicache-storage-backend)
    kv_ready: Any = None  # KVReady of the last forward that wrote this request's KV (the transfer waits on it)
    spec_verify_ct: int = 0  # speculative decoding: verify forwards this request took part in (SGLang's meta)
    spec_accepted: int = 0  # draft tokens they accepted

    # runtime helpers, owned by the scheduler
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopStringMatcher | None = None
    grammar: ReqGrammar | None = None  # its own matcher over grammar_spec's compilation (common/engine/grammar/)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    timeline: Timeline = field(default_factory=Timeline)  # diagnostics: see common/core/timeline.py

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs before it can sample the next one."""
        return self.prompt_ids + self.output_ids

    @property
    def cache_key(self) -> list[int]:
        """fill_ids as the prefix cache keys them: in the namespace of its adapter, so the same tokens under two
        adapters (or one and the base model) never share a page."""
        ids = self.fill_ids
        return ids if not self.lora_id else [t + self.lora_id * LORA_KEY_STRIDE for t in ids]

    @property
    def resumed_ids(self) -> list[int]:
        return self.prompt_ids[len(self.prompt_ids) - self.resumed_len :]

    @property
    def generated_ids(self) -> list[int]:
        """Every token generated for this choice: on earlier servers (a migrated request's) and here."""
        return self.resumed_ids + self.output_ids if self.resumed_len else self.output_ids

    @property
    def generated_len(self) -> int:
        return self.resumed_len + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def queue_position(queue: Sequence[Req], req: Req, ahead_of_equals: bool = False) -> int:
    """Where `req` goes in a queue kept in priority order (higher first): behind every request of its
    priority (FIFO among equals; all 0 without --enable-priority-scheduling), or ahead of them."""
    if not ahead_of_equals and (not queue or queue[-1].priority >= req.priority):
        return len(queue)  # the common case (no priorities): no walk over the queue
    for i, other in enumerate(queue):
        if other.priority < req.priority or (ahead_of_equals and other.priority == req.priority):
            return i
    return len(queue)

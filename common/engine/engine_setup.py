"""What an Engine derives at start-up from its config, model and KV pool: the context length, the EOS ids, the
batch limits on CUDA, the KV event publisher, the grammar backend and the KV store's namespace. Each is a
function of what it is given (and logs at most a line); common/engine/engine_build.py calls them in order."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig

from common.config import ServerConfig
from common.engine.kv_event_publisher import KVEventPublisher, no_adapters
from common.engine.metrics import EngineMetrics
from common.memory.sizing import PoolPlan, gpu_batch_limits, plan_context_len
from common.memory.static_reserve import cap_running_requests
from common.memory.store.keys import store_namespace
from common.model.identity import weights_fingerprint
from common.wire.kv_events import parse_kv_events_config

log = logging.getLogger(__name__)


def context_len_for(hf_config: PretrainedConfig, config: ServerConfig, pool_plan: PoolPlan) -> int:
    """The longest sequence served: the model's, --context-length's, or what the pool holds (with a warning)."""
    model_max = getattr(hf_config, "max_position_embeddings", 4096)
    context_len, warning = plan_context_len(model_max, config.context_length, pool_plan)
    if warning:
        log.warning("%s", warning)
    return context_len


def eos_token_ids(model_dir: Path, tokenizer) -> set[int]:
    """The generation config's EOS ids (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def batch_limits(config: ServerConfig, pool_plan: PoolPlan, context_len: int, vocab_size: int) -> ServerConfig:
    """On CUDA, the batch limits the flags leave unset, derived from the device and the pool."""
    if config.device != "cuda":
        return config
    total = torch.cuda.mem_get_info()[1]
    derived = gpu_batch_limits(total, pool_plan, context_len)
    unset = {k: v for k, v in derived.items() if k not in config.model_fields_set}  # chunks: whole pages (<= 256)
    running = unset.get("max_running_requests", config.max_running_requests)
    left = total * (1 - config.mem_fraction_static)  # what the pool's sizing left: the sampler's rows come from it
    rows = 1 + config.speculative_draft_len  # a verify samples every position
    capped, warning = cap_running_requests(running, left, vocab_size, "max_running_requests" not in unset, rows)
    if warning:
        log.warning("%s", warning)
    unset["max_running_requests"] = capped
    log.info(
        "batch limits for this GPU and pool: %s (flags override; running requests within what the sampler's "
        "temporaries leave)",
        ", ".join(f"{k} {v}" for k, v in unset.items()),
    )
    return config.model_copy(update=unset)


def make_kv_event_publisher(
    config: ServerConfig, metrics: EngineMetrics, adapter_name: Callable[[int], str | None] = no_adapters
) -> KVEventPublisher | None:
    """--kv-events-config's publisher (None when off, or when there is no prefix cache to report on);
    `adapter_name`: a lora_id's adapter (--enable-lora)."""
    events = parse_kv_events_config(config.kv_events_config)
    if events is None or config.disable_radix_cache:
        return None
    publisher = KVEventPublisher(events, config.page_size, config.public_host, adapter_name)
    metrics.counter_source(
        "tandem_kv_events_dropped",
        "KV cache events dropped because the publisher's queue was full",
        lambda: publisher.dropped,
    )
    metrics.counter_source("tandem_kv_event_batches", "KV cache event batches published", lambda: publisher.batches)
    return publisher


def kv_store_namespace(config: ServerConfig, kv_buffer: torch.Tensor, model_id: str, model_dir: Path) -> str:
    """What names this server's pages in a KV store besides their tokens (common/memory/store/keys.py); empty
    without --hicache-storage-backend."""
    if not config.hicache_storage_backend:
        return ""
    return store_namespace(
        model=model_id,
        weights=weights_fingerprint(model_dir),
        dtype=kv_buffer.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        page=tuple(kv_buffer.shape[1:]),
        tp=f"0/{config.tp_size}",
    )


def make_grammar_backend(config: ServerConfig, vocab_size: int, tokenizer, eos_ids: set[int], schedulers: list):
    """xgrammar over this tokenizer (None with --grammar-backend none), and each scheduler's queue of requests
    waiting for their grammar (a DP rank's requests wait in its own). Where xgrammar does not import: a
    UserError if the flag asked for it, else one warning and GrammarOff (constrained requests get a 400)."""
    if config.grammar_backend == "none":
        return None
    from common.engine.grammar.availability import GrammarOff, check_grammar_backend, xgrammar_import_error

    check_grammar_backend(config)
    if (error := xgrammar_import_error()) is not None:
        log.warning(
            "constrained decoding is off: xgrammar does not import (%s); unconstrained requests are served, "
            "constrained ones (json_schema, regex, ebnf, tool_choice required) get a 400",
            error,
        )
        return GrammarOff(error)
    from common.engine.grammar.backend import GrammarBackend
    from common.engine.grammar.queue import GrammarQueue

    backend = GrammarBackend(
        tokenizer,
        max(vocab_size, len(tokenizer)),
        eos_ids,
        config.grammar_cache_size,
        not config.constrained_json_disable_any_whitespace,
        config.constrained_json_max_whitespace,
    )
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    end = "</think>" if config.reasoning_parser else None
    for scheduler in schedulers:
        scheduler.grammars = GrammarQueue(backend, scheduler.wake, decode, end)
    return backend

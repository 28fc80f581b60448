"""The start-up step after the warm-up: the CUDA graphs `graph_plan` allows, captured into one memory pool
(common/engine/cuda_graph.py has the graphs themselves), and what their existence changes (NGRAM pads its
drafts so a verify can replay one)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from common.attention.choice import resolved_backend
from common.core.page_meta import pages_for
from common.engine.cuda_graph import StepGraphs
from common.memory.static_reserve import graph_plan
from common.model.registry import model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from common.config import ServerConfig
    from common.engine.engine_parts import MemoryParts
    from common.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


def capture_graphs(
    c: ServerConfig, memory: MemoryParts, scheduler: Scheduler, hf_config: PretrainedConfig, dp_attention: bool
) -> float:
    """The CUDA graphs graph_plan allows (after the warm-up built the kernels) for `scheduler`'s runner, into one
    memory pool: a speculative server's verify steps (k + 1 tokens per request), then its decode steps; the
    seconds. None under DP attention."""
    pool, runner = memory.kv_pool, scheduler.runner
    backend = resolved_backend(c.attention_backend, c.device, pool.kind, pool.quantized)
    sizes, line = graph_plan(c, backend, model_class(hf_config).cuda_graph_capturable and not dp_attention)
    log.info("%s", line)
    if not sizes:
        return 0.0
    slots = min(sizes[-1] * pages_for(memory.context_len, c.page_size), pool.num_pages + sizes[-1])
    kinds = [1 + c.speculative_draft_len] if c.speculative_draft_len else []
    free, start, graph_pool = torch.cuda.mem_get_info()[0], time.monotonic(), torch.cuda.graph_pool_handle()
    for tokens in [*kinds, 1]:
        runner.attn.prepare_graphs(sizes[-1], slots + sizes[-1] * pages_for(tokens, c.page_size), tokens)
        graphs = StepGraphs(
            runner.model, runner.attn, runner.req_to_token, scheduler.memory.req_pool.padding_row,
            sizes, hf_config.vocab_size, c.device, tokens=tokens,
        )  # fmt: skip
        graphs.capture_all(graph_pool)
        runner.graphs.append(graphs)
    if kinds:  # a verify a graph can run: every request's full draft
        scheduler.decode.spec.pad_drafts = True
    seconds, used = time.monotonic() - start, free - torch.cuda.mem_get_info()[0]
    log.info(
        "CUDA graphs: %d sizes of %s captured in %.1f s, %.0f MiB (%.0f MiB set aside before the KV pool)",
        len(sizes),
        " and ".join("verify" if t > 1 else "decode" for t in [*kinds, 1]) + " steps",
        seconds,
        used / 2**20,
        memory.reserved.cuda_graphs / 2**20,
    )
    return seconds

"""What an engine reports: /get_server_info's answer and the /metrics gauges, summed over the DP ranks
under DP attention (`dp` has each DP rank's), with the ranks' reports, the bytes rank 0 sent into
collectives (`tp`) and the expert placement (`ep`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine import host_tier
from common.model.moe import expert_placement
from common.parallel import group

if TYPE_CHECKING:
    from common.config import ServerConfig
    from common.engine.engine_parts import EngineParts, MemoryParts, RankParts, SchedulerParts
    from common.engine.metrics import EngineMetrics
    from common.engine.scheduler import Scheduler


def register_engine_gauges(m: EngineMetrics, memory: MemoryParts, ss: list[Scheduler]) -> None:
    """The engine's gauges on its /metrics."""
    ms = memory.managers
    m.gauge("tandem_num_running_reqs", "requests decoding", lambda: sum(len(s.decode.running) for s in ss))
    m.gauge("tandem_num_queue_reqs", "requests waiting for prefill", lambda: sum(len(s.prefill.waiting) for s in ss))
    total = memory.pool_plan.num_pages * len(ms)
    m.gauge("tandem_kv_pages_total", "KV pages", lambda: total)
    free = lambda: sum(x.allocator.available_pages() for x in ms)  # noqa: E731
    cached = lambda: sum(x.prefix_cache.evictable_pages() for x in ms)  # noqa: E731
    m.gauge("tandem_kv_pages_free", "KV pages free", free)
    m.gauge("tandem_kv_pages_cached", "KV pages of the prefix cache that no request uses (reclaimable)", cached)
    m.gauge(
        "tandem_kv_pages_used",
        "KV pages requests hold (total = free + cached + used)",
        lambda: total - free() - cached(),
    )
    page_bytes = sum(b.bytes_per_page for b in memory.kv_pool.buffer_infos())
    m.gauge("tandem_kv_page_bytes", "bytes of one KV page (every layer's K and V) on this rank", lambda: page_bytes)
    host_tier.register_gauges(m, memory.first.prefix_cache)
    m.registry.register(ss[0].forward_stats)  # DP rank 0's forwards under DP attention (all ranks run each one)
    m.gauge(
        "tandem_prefill_queue_tokens",
        "prompt tokens still to compute of the requests waiting for prefill and the chunked one",
        lambda: sum(s.prefill.pending_tokens() for s in ss),
    )
    m.labelled_gauges(
        "tandem_pd_queue_requests",
        "requests in the PD role's queues (prefill: awaiting_decode, deferred, "
        "inflight; decode: prealloc, transferring, quarantined)",
        "queue",
        lambda: queue_depths(ss),
    )


def queue_depths(schedulers: list[Scheduler]) -> dict[str, int]:
    """The PD roles' queues, summed over the DP ranks."""
    out: dict[str, int] = {}
    for s in schedulers:
        for k, v in s.role.queue_depths().items():
            out[k] = out.get(k, 0) + v
    return out


def engine_info(parts: EngineParts) -> dict:
    """What /get_server_info reports (on the scheduler thread: raises on a leak)."""
    config, memory, sp = parts.config, parts.memory, parts.schedulers
    ss, cache = sp.schedulers, memory.first.prefix_cache
    return {
        "config": config.model_dump(exclude={"api_key", "cluster_secret"}),
        "model_path": str(parts.model.model_dir),
        "context_length": memory.context_len,
        "kv_pages": sp.top.check_integrity().to_dict(),
        "host_tier": host_tier.info(cache),
        "kv_store": host_tier.store_info(cache),
        "num_running_reqs": sum(len(s.decode.running) for s in ss),
        "num_waiting_reqs": sum(len(s.prefill.waiting) for s in ss),
        "num_retractions": sum(s.decode.num_retractions for s in ss),
        "role": ss[0].role.info() | queue_depths(ss),
        "tp": tp_info(config, parts.ranks),
        "dp": dp_info(config, parts.ranks, sp),
        "ep": ep_info(config, parts.ranks),
        "kv_events": memory.kv_events.info() if memory.kv_events is not None else None,
        "grammar": sp.grammar.info_dict() if sp.grammar is not None else None,
        "calibration": ss[0].forward_stats.calibration.to_dict(),
        "lora": parts.runners[0].lora.report() if parts.runners[0].lora is not None else None,
    }


def tp_info(config: ServerConfig, ranks: RankParts) -> dict:
    """The ranks' reports; rank 0's bytes sent into each kind of collective over its `forwards` steps."""
    steps = ranks.ranks.step if ranks.ranks is not None else 0
    out = {"ranks": ranks.reports, "forwards": steps, "bytes_sent": dict(group.SENT)}
    return {"size": config.tp_size, "nnodes": config.nnodes} | out


def dp_info(config: ServerConfig, ranks: RankParts, sp: SchedulerParts) -> dict | None:
    """DP attention: the DP size, the balancing method and each DP rank's load."""
    if ranks.dp is None:
        return None
    return {"size": len(sp.schedulers), "load_balance_method": config.lb_method, "ranks": sp.top.info()}


def ep_info(config: ServerConfig, ranks: RankParts) -> dict | None:
    """Expert parallelism: each MoE layer's experts per rank (every rank computes the same), EPLB's counts."""
    if config.ep_size == 1:
        return None
    eplb = ranks.rebalancer.info() if ranks.rebalancer is not None else None
    return {"size": config.ep_size, "placement": expert_placement(ranks.model), "eplb": eplb}

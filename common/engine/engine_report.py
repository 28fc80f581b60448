"""What an engine reports: /get_server_info's answer and the /metrics gauges, summed over the DP ranks
under DP attention (`dp` has each DP rank's), with the ranks' reports, the bytes rank 0 sent into
collectives (`tp`) and the expert placement (`ep`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine import host_tier
from common.model.moe import expert_placement
from common.parallel import group

if TYPE_CHECKING:
    from common.engine.engine import Engine


def register_engine_gauges(engine: Engine) -> None:
    """The engine's gauges on its /metrics."""
    m, ss, ms = engine.metrics, engine.schedulers, engine.memories
    m.gauge("tandem_num_running_reqs", "requests decoding", lambda: sum(len(s.decode.running) for s in ss))
    m.gauge("tandem_num_queue_reqs", "requests waiting for prefill", lambda: sum(len(s.prefill.waiting) for s in ss))
    total = engine.pool_plan.num_pages * len(ms)
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
    page_bytes = sum(b.bytes_per_page for b in engine.kv_pool.buffer_infos())
    m.gauge("tandem_kv_page_bytes", "bytes of one KV page (every layer's K and V) on this rank", lambda: page_bytes)
    host_tier.register_gauges(m, engine.memory.prefix_cache)
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
        lambda: queue_depths(engine),
    )


def queue_depths(engine: Engine) -> dict[str, int]:
    """The PD roles' queues, summed over the DP ranks."""
    out: dict[str, int] = {}
    for s in engine.schedulers:
        for k, v in s.role.queue_depths().items():
            out[k] = out.get(k, 0) + v
    return out


def engine_info(engine: Engine) -> dict:
    """What /get_server_info reports (on the scheduler thread: raises on a leak)."""
    ss = engine.schedulers
    return {
        "config": engine.config.model_dump(exclude={"api_key", "cluster_secret"}),
        "model_path": str(engine.model_dir),
        "context_length": engine.context_len,
        "kv_pages": engine.scheduler.check_integrity().to_dict(),
        "host_tier": host_tier.info(engine.memory.prefix_cache),
        "kv_store": host_tier.store_info(engine.memory.prefix_cache),
        "num_running_reqs": sum(len(s.decode.running) for s in ss),
        "num_waiting_reqs": sum(len(s.prefill.waiting) for s in ss),
        "num_retractions": sum(s.decode.num_retractions for s in ss),
        "role": engine.role.info() | queue_depths(engine),
        "tp": tp_info(engine),
        "dp": dp_info(engine),
        "ep": ep_info(engine),
        "kv_events": engine.kv_events.info() if engine.kv_events is not None else None,
        "grammar": engine.grammar.info_dict() if engine.grammar is not None else None,
        "calibration": ss[0].forward_stats.calibration.to_dict(),
    }


def tp_info(engine: Engine) -> dict:
    """The ranks' reports; rank 0's bytes sent into each kind of collective over its `forwards` steps."""
    steps = engine.ranks.step if engine.ranks is not None else 0
    ranks = {"ranks": engine.rank_reports, "forwards": steps, "bytes_sent": dict(group.SENT)}
    return {"size": engine.config.tp_size, "nnodes": engine.config.nnodes} | ranks


def dp_info(engine: Engine) -> dict | None:
    """DP attention: the DP size, the balancing method and each DP rank's load."""
    if engine.dp is None:
        return None
    return {"size": engine.dp_size, "load_balance_method": engine.config.lb_method, "ranks": engine.scheduler.info()}


def ep_info(engine: Engine) -> dict | None:
    """Expert parallelism: each MoE layer's experts per rank (every rank computes the same), EPLB's counts."""
    if engine.config.ep_size == 1:
        return None
    eplb = engine.rebalancer.info() if engine.rebalancer is not None else None
    return {"size": engine.config.ep_size, "placement": expert_placement(engine.model), "eplb": eplb}

"""Compose the decode role: engine + aux pool + DecodeKVManager + peer directory (cached lookups)."""

from __future__ import annotations

import logging

from common.config import ServerConfig
from common.engine.engine import Engine
from common.engine.role import SchedulerView
from common.wire.kv_layout import model_kv_heads
from decode_node.peers import PeerDirectory
from decode_node.role import DecodeRole
from transfer.aux_record import RECORD_BYTES
from transfer.decode.aux_pool import AuxPool
from transfer.decode.decode_manager import DecodeKVManager
from transfer.manager import kv_args_from_pool

log = logging.getLogger(__name__)


def build_decode_engine(config: ServerConfig, follower: str) -> Engine:
    """A decode server's engine; `follower`: the module its follower ranks run (one that starts their
    transfer agents)."""

    def make_role(engine: Engine) -> list[DecodeRole]:
        config = engine.config  # with the batch limits derived for the device
        aux = AuxPool((2 * config.max_running_requests + 16) * len(engine.schedulers))  # a share per DP rank
        kv_heads = model_kv_heads(engine.kv_pool, engine.hf_config, config.tp_size)
        args = kv_args_from_pool(
            engine.kv_pool, config, aux.data_ptr, RECORD_BYTES, aux.num_slots, kv_heads, engine.followers_transfer
        )
        manager = DecodeKVManager(args, wake_scheduler=engine.scheduler.wake)
        engine.metrics.registry.register(manager.metrics)
        engine.metrics.add_rejection_source("control", lambda: manager.counters["rejected_messages"])
        layout = engine.kv_layout(kv_heads)
        log.info("KV layout: %s", layout)
        peers = PeerDirectory(layout, config.cluster_secret, tls=config.peer_tls)
        manager.on_peer_dead.append(peers.invalidate)
        vocab = engine.hf_config.vocab_size
        shares = aux.shares(len(engine.schedulers))
        return [
            DecodeRole(SchedulerView(s), manager, share, peers.find, vocab, config)
            for s, share in zip(engine.schedulers, shares)
        ]

    return Engine(config, make_role, follower)

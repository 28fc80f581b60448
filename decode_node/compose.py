"""Compose the decode role: engine + aux pool + DecodeKVManager + peer directory (cached lookups), at start-up
and after a role switch to decode."""

from __future__ import annotations

import logging

from common.config import ServerConfig
from common.engine.engine import Engine
from common.engine.role import SchedulerView
from common.wire.kv_layout import model_kv_heads
from decode_node.peers import PeerDirectory
from decode_node.role import DecodeRole
from transfer.aux_record import record_bytes
from transfer.backends.shared import SharedBackend
from transfer.decode.aux_pool import AuxPool
from transfer.decode.decode_manager import DecodeKVManager
from transfer.manager import kv_args_from_pool

log = logging.getLogger(__name__)


def build_decode_engine(config: ServerConfig, follower: str) -> Engine:
    """A decode server's engine; `follower`: the module its follower ranks run (one that starts their
    transfer agents)."""
    return Engine(config, DecodeComposer().make_role, follower)


class DecodeComposer:
    """Makes an engine's decode role: at start-up, and again after each role switch to decode
    (--enable-pd-role-switch: `shared` is then the process's one transfer engine). The aux pool is made once and
    kept (its memory stays registered with that engine)."""

    def __init__(self, shared: SharedBackend | None = None):
        self.shared = shared
        self.aux: AuxPool | None = None

    def make_role(self, engine: Engine) -> list[DecodeRole]:
        """One role per DP rank's scheduler: one transfer engine, a share of the aux pool each."""
        config = engine.config  # with the batch limits derived for the device
        slots = (2 * config.max_running_requests + 16) * len(engine.schedulers)
        size = record_bytes(engine.aux_hidden_bytes)  # NEXTN's and EAGLE's records carry a hidden state
        aux = self.aux = self.aux or AuxPool(slots, slot_bytes=size)
        kv_heads = model_kv_heads(engine.kv_pool, engine.hf_config, config.tp_size)
        args = kv_args_from_pool(
            engine.kv_pool, config, aux.data_ptr, size, aux.num_slots, kv_heads, engine.followers_transfer
        )
        manager = DecodeKVManager(args, wake_scheduler=engine.scheduler.wake, shared=self.shared)
        engine.metrics.registry.register(manager.metrics)
        engine.metrics.add_rejection_source("control", lambda: manager.counters["rejected_messages"])
        layout = engine.kv_layout(kv_heads)
        log.info("KV layout: %s", layout)
        peers = PeerDirectory(layout, config.cluster_secret, tls=config.peer_tls)
        manager.on_peer_dead.append(peers.invalidate)
        vocab = engine.hf_config.vocab_size
        shares = aux.shares(len(engine.schedulers))
        roles = [
            DecodeRole(SchedulerView(s), manager, share, peers.find, vocab, config, engine.hidden_handoff)
            for s, share in zip(engine.schedulers, shares)
        ]
        roles[0].on_close += [peers.close, lambda: engine.metrics.drop_transfer_metrics(manager.metrics)]
        return roles

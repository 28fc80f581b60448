"""Compose the decode role from a RoleContext: aux pool + DecodeKVManager + peer directory (cached lookups), at start-up
and after a role switch to decode."""

from __future__ import annotations

import logging

from common.engine.role import RoleContext
from decode_node.peers import PeerDirectory
from decode_node.role import DecodeRole
from transfer.aux_record import record_bytes
from transfer.backends.shared import SharedBackend
from transfer.decode.aux_pool import AuxPool
from transfer.decode.decode_manager import DecodeKVManager
from transfer.manager import kv_args_from_pool

log = logging.getLogger(__name__)


class DecodeComposer:
    """Makes an engine's decode role: at start-up, and again after each role switch to decode
    (--enable-pd-role-switch: `shared` is then the process's one transfer engine). The aux pool is made once and
    kept (its memory stays registered with that engine)."""

    def __init__(self, shared: SharedBackend | None = None):
        self.shared = shared
        self.aux: AuxPool | None = None

    def make_role(self, ctx: RoleContext) -> list[DecodeRole]:
        """One role per DP rank's scheduler: one transfer engine, a share of the aux pool each."""
        config = ctx.config
        slots = (2 * config.max_running_requests + 16) * len(ctx.views)
        size = record_bytes(ctx.aux_hidden_bytes)  # NEXTN's and EAGLE's records carry a hidden state
        aux = self.aux = self.aux or AuxPool(slots, slot_bytes=size)
        args = kv_args_from_pool(
            ctx.kv_pool, config, aux.data_ptr, size, aux.num_slots, ctx.kv_heads, ctx.followers_transfer
        )
        manager = DecodeKVManager(args, wake_scheduler=ctx.wake_scheduler, shared=self.shared)
        ctx.metrics.registry.register(manager.metrics)
        ctx.metrics.add_rejection_source("control", lambda: manager.counters["rejected_messages"])
        log.info("KV layout: %s", ctx.kv_layout)
        peers = PeerDirectory(ctx.kv_layout, config.cluster_secret, tls=config.peer_tls)
        manager.on_peer_dead.append(peers.invalidate)
        shares = aux.shares(len(ctx.views))
        roles = [
            DecodeRole(view, manager, share, peers.find, ctx.vocab_size, config, ctx.hidden_handoff)
            for view, share in zip(ctx.views, shares)
        ]
        roles[0].on_close += [peers.close, lambda: ctx.metrics.drop_transfer_metrics(manager.metrics)]
        return roles

"""Compose the prefill role from a RoleContext: PrefillKVManager + (embedded) bootstrap registration, at start-up and after
a role switch to prefill."""

from __future__ import annotations

import logging
import threading
from typing import Any

from bootstrap.client import register_prefill
from common.edge.tls import server_context
from common.engine.role import RoleContext
from common.wire.kv_layout import LAYOUT_KEYS
from prefill_node.role import PrefillRole
from transfer.aux_record import record_bytes
from transfer.backends.shared import SharedBackend
from transfer.manager import kv_args_from_pool
from transfer.prefill.prefill_manager import PrefillKVManager

log = logging.getLogger(__name__)
REREGISTER_MAX_S = 15.0  # the registry expires entries not refreshed for a minute


class PrefillComposer:
    """Makes an engine's prefill role: at start-up, and again after each role switch to prefill
    (--enable-pd-role-switch: `shared` is then the process's one transfer engine). The embedded bootstrap registry
    is started once and kept."""

    def __init__(self, shared: SharedBackend | None = None):
        self.shared = shared
        self.bootstrap_url: str | None = None

    def make_role(self, ctx: RoleContext) -> list[PrefillRole]:
        """One role per DP rank's scheduler, sharing one transfer engine and registered once per DP rank."""
        config = ctx.config
        size = record_bytes(ctx.aux_hidden_bytes)
        args = kv_args_from_pool(ctx.kv_pool, config, 0, size, 0, ctx.kv_heads, ctx.followers_transfer)
        manager = PrefillKVManager(
            args, rank_fault=ctx.rank_fault, wake_scheduler=ctx.wake_scheduler, shared=self.shared
        )
        ctx.metrics.registry.register(manager.metrics)
        ctx.metrics.add_rejection_source("control", lambda: manager.counters["rejected_messages"])
        bootstrap_url = self._bootstrap_url(ctx)
        host, port = manager.endpoint.removeprefix("tcp://").rsplit(":", 1)
        info = {
            "role": "Prefill",
            "instance_id": manager.instance_id,
            "rank_ip": host,
            "rank_port": int(port),
            **ctx.kv_layout,
        }
        log.info("KV layout: %s", {k: info[k] for k in LAYOUT_KEYS})
        # one entry per DP rank (SGLang's: a decode may look a DP rank up), all at this control endpoint
        dp_size = len(ctx.views)
        attn_tp = config.tp_size // dp_size
        infos = [info | {"dp_rank": d, "tp_rank": d * attn_tp} for d in range(dp_size)]
        verify = config.peer_tls or True  # an https:// --bootstrap-url is verified even where this server is plain
        for entry in infos:
            register_prefill(bootstrap_url, entry, config.cluster_secret, verify=verify)
        interval_s = min(config.heartbeat_interval_s, REREGISTER_MAX_S)
        stop = keep_registered(bootstrap_url, infos, config.cluster_secret, interval_s, verify)
        log.info(
            "registered with bootstrap %s as %s (control endpoint %s)",
            bootstrap_url,
            manager.instance_id,
            manager.endpoint,
        )
        roles = [PrefillRole(view, manager, config, ctx.hidden_handoff) for view in ctx.views]
        roles[0].on_close += [stop.set, lambda: ctx.metrics.drop_transfer_metrics(manager.metrics)]
        return roles

    def _bootstrap_url(self, ctx: RoleContext) -> str:
        """--bootstrap-url, or this server's embedded registry (started by the first prefill role)."""
        config = ctx.config
        if config.bootstrap_url is not None:
            return config.bootstrap_url
        if self.bootstrap_url is None:
            from bootstrap.app import start_in_thread

            tls = server_context(config.ssl_certfile, config.ssl_keyfile) if config.ssl_certfile else None
            registry = start_in_thread(config.host, config.bootstrap_port, config.cluster_secret, tls)
            ctx.metrics.add_rejection_source("bootstrap", lambda: registry.rejected)
            self.bootstrap_url = f"{config.scheme}://{config.public_host}:{config.bootstrap_port}"
        return self.bootstrap_url


def keep_registered(
    url: str, infos: list[dict[str, Any]], secret: str | None, interval_s: float, verify: str | bool
) -> threading.Event:
    """Register every DP rank's entry again every interval, so a restarted bootstrap server learns this prefill
    within one; until the event returned is set (the role ended)."""
    stop = threading.Event()

    def loop() -> None:
        reachable = True
        while not stop.wait(interval_s):
            try:
                for info in infos:
                    register_prefill(url, info, secret, timeout_s=0, verify=verify)
            except RuntimeError as e:
                if reachable:
                    log.warning("%s; registering again every %.1f s", e, interval_s)
                reachable = False
                continue
            if not reachable:
                log.info("registered with bootstrap %s again", url)
            reachable = True

    threading.Thread(target=loop, name="bootstrap-register", daemon=True).start()
    return stop

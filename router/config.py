"""One config object for the router process: every field is a `tandem router` flag and a
`TANDEM_ROUTER_*` environment variable (the API key is `TANDEM_API_KEY`, shared with the servers)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.wire.addresses import split_host_port
from common.wire.body import ARRIVAL_TIMEOUT_S
from router.placement.policies import POLICIES

Policy = Literal[tuple(POLICIES)]  # type: ignore[valid-type]
POLICY_HELP = "; ".join(f"{name}: {spec.summary}" for name, spec in POLICIES.items())
DISCOVERY_EXAMPLE = "tandem-prefill.default.svc.cluster.local:30000"
SECRET_FIELDS = frozenset({"api_key", "worker_api_key"})  # never shown (logs, /get_server_info)


class PrefillSpec(BaseModel):
    url: str
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    # the bootstrap registry this prefill registered with, when it is not the prefill's own (a standalone one)
    bootstrap_host: str | None = Field(None, min_length=1, max_length=255)


class WorkerChange(BaseModel):
    """The body of `POST /workers` (url and role; a prefill's bootstrap port, and host for a standalone
    registry) or of `DELETE /workers` (url only)."""

    url: str = Field(pattern=r"^https?://[^\s/]+/?$", max_length=2048)
    role: Literal["prefill", "decode"] | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_host: str | None = Field(None, min_length=1, max_length=255)


class RouterConfig(BaseSettings):
    """From the environment: `TANDEM_ROUTER_PREFILL='[{"url": "http://p0:30000", "bootstrap_port": 8998}]'`,
    `TANDEM_ROUTER_DECODE='["http://d0:30000"]'`, `TANDEM_ROUTER_HEALTH_FAILURE_THRESHOLD=3`, ..."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_", extra="forbid", populate_by_name=True)

    prefill: list[PrefillSpec] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    policy: Policy = Field("cache_aware", description=f"how the prefill, and the decode, are picked ({POLICY_HELP})")
    decode_policy: Policy | None = Field(
        None,
        description="how the decode is picked, when not by --policy (SGLang's flag; cache_aware's decode default is "
        "power_of_two): cache_aware or kv_aware send a conversation's next turn to the decode whose cache holds it",
    )
    host: str = "127.0.0.1"
    kv_load_tokens: int = Field(
        64,
        ge=0,
        description="kv_aware: the cost, in prompt tokens, of one request in flight on a worker (the cost of a pair "
        "is the tokens its prefill computes + the tokens whose KV crosses to its decode + this x their requests)",
    )
    kv_host_hit_weight: float = Field(
        1.0,
        ge=0,
        le=1,
        description="kv_aware: what a page in a worker's host tier saves, as a share of one on its device "
        "(Dynamo's --router-host-cache-hit-weight)",
    )
    kv_store_hit_weight: float = Field(
        0.5,
        ge=0,
        le=1,
        description="kv_aware: what a page only the KV store every server shares holds saves a prefill that "
        "reads from it (--hicache-storage-backend), as a share of one on its device",
    )
    pd_placement: Literal["remote", "two_way", "cost"] = Field(
        "remote",
        description="where a prompt is computed (docs/placement.md): remote: always on a prefill; two_way: on the "
        "decode when the part it lacks is shorter than --placement-local-threshold (Dynamo's and llm-d's rule); "
        "cost: the least of one measured cost over every pair and every decode alone (needs the workers' KV events)",
    )
    placement_local_threshold: int = Field(
        256, ge=0, description="two_way: prompts whose uncached part on the decode is shorter are computed there"
    )
    placement_poll_interval_s: float = Field(
        1.0, gt=0, description="cost: seconds between two scrapes of each worker's /metrics (its measured rates)"
    )
    adapter_routing: bool = Field(
        True,
        description="read each worker's LoRA adapters (its /v1/models) with its health checks: an adapter's request "
        "goes to workers that list it, kv_aware keys its pages by adapter, one no worker has is a 404; off, a "
        "request is placed as the base model's",
    )
    slo_priority: bool = Field(
        False,
        description="give a request with an x-slo-ttft-ms header a priority (tighter first, above requests without "
        "one) unless it has one; the workers must run --enable-priority-scheduling",
    )
    pd_role_switch_timeout_s: float = Field(
        300.0,
        gt=0,
        validation_alias=AliasChoices(
            "TANDEM_ROUTER_PD_ROLE_SWITCH_TIMEOUT_S", "TANDEM_ROUTER_ROLE_SWITCH_TIMEOUT_S"
        ),  # the old name too
        description="POST /pd_role_switch: how long a worker may take to finish its requests and switch (the "
        "workers' own --pd-role-switch-timeout-s bounds their side)",
    )
    port: int = Field(8000, ge=1, le=65535)
    health_check_interval_s: float = Field(5.0, gt=0, description="seconds between two health checks of a worker")
    health_check_timeout_s: float = Field(2.0, gt=0, description="a GET /health slower than this is a failure")
    health_failure_threshold: int = Field(2, ge=1, description="failures in a row that take a worker out of rotation")
    request_timeout_s: float = Field(1800.0, gt=0, description="the longest one request may take end to end")
    migration_limit: int = Field(
        3,
        ge=0,
        description="times one request may move to another pair when its pair fails (Dynamo's flag): a stream goes "
        "on from the tokens it has shown, a JSON answer starts over; 0 turns migration off",
    )
    migration_max_seq_len: int | None = Field(
        None, ge=1, description="a request whose prompt + tokens shown are longer than this does not move"
    )
    max_concurrent_requests: int = Field(4096, ge=1, description="requests in flight beyond this are answered 429")
    responses_store_size: int = Field(
        1000, ge=1, description="stored responses kept for previous_response_id and GET (the oldest evicted first)"
    )
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="larger request bodies are answered 413")
    head_timeout_s: float = Field(
        ARRIVAL_TIMEOUT_S,
        gt=0,
        description="a connection whose whole request head has not arrived this long after it opened, or after "
        "its previous answer, is closed unanswered (a client sending nothing, or its head slowly, holds no connection)",
    )
    prefill_discovery: str | None = Field(
        None,
        description="HOST:PORT; every address HOST resolves to (e.g. a headless Service's pods) is a prefill server, re-resolved every --discovery-interval-s",
    )
    decode_discovery: str | None = Field(None, description="HOST:PORT; the same for decode servers")
    discovery_interval_s: float = Field(
        10.0, gt=0, description="seconds between two resolutions of the discovery names"
    )
    prefill_bootstrap_port: int = Field(8998, ge=1, le=65535, description="the bootstrap port of discovered prefills")
    prefill_bootstrap_host: str | None = Field(
        None,
        description="the standalone bootstrap registry discovered prefills registered with (default: each prefill's own address)",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM: how long requests in flight may run on before the router exits"
    )
    processes: int = Field(
        1,
        ge=1,
        description="router processes serving the port (SO_REUSEPORT), for more than "
        "one core; what they share is in router/processes.py",
    )
    api_key: str | None = Field(
        None,
        validation_alias="TANDEM_API_KEY",
        description="clients must send it (Authorization: Bearer); the router sends it to its workers too",
    )
    worker_api_key: str | None = Field(
        None, description="the key the router sends to its workers when it is not --api-key"
    )
    ssl_certfile: str | None = Field(None, description="PEM certificate (chain) of the router's HTTPS listener")
    ssl_keyfile: str | None = Field(None, description="PEM private key of --ssl-certfile")
    ssl_ca_certs: str | None = Field(
        None,
        description="PEM CA certificates that verify https:// workers (default: the system's); with it, "
        "discovered workers are https, each certificate verified against the discovery name",
    )

    @property
    def worker_key(self) -> str | None:
        """What the router sends to its workers as `Authorization: Bearer`."""
        return self.worker_api_key or self.api_key

    @field_validator("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(value):
            raise ValueError(f"{value!r} is not a file")
        return value

    @model_validator(mode="after")
    def _tls_pair_and_keys(self) -> RouterConfig:
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        for flag, key in (("--api-key", self.api_key), ("--worker-api-key", self.worker_api_key)):
            if key and not (key.isascii() and key.isprintable() and " " not in key):
                # said without the key itself: an error message must not show a secret
                raise ValueError(f"{flag}: a key is one word of printable ASCII (it is sent in a header line)")
        return self

    @field_validator("prefill_discovery", "decode_discovery")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value, DISCOVERY_EXAMPLE)
        return value

"""One config object for `tandem epp`: every field is a flag and a `TANDEM_EPP_*` environment variable. The fields it
shares with the router are the router's own (the same name, default and help), so the two cannot drift."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from router.config import Policy, PrefillSpec, RouterConfig

_R = RouterConfig.model_fields


class EppConfig(BaseSettings):
    """`worker` lists monolithic servers; `prefill` and `decode` PD pairs (the decode's URL is its pod's pair sidecar,
    `tandem sidecar`, which the gateway sends the request to). Not both."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_EPP_", extra="forbid", populate_by_name=True)

    worker: list[str] = Field(default_factory=list, description="a monolithic server's URL (repeat for each)")
    prefill: list[PrefillSpec] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    worker_discovery: str | None = Field(
        None, description="HOST:PORT; every address HOST resolves to is a monolithic server (as --decode-discovery)"
    )
    grpc_port: int = Field(
        9002, ge=1, le=65535, description="the ext_proc gRPC port the gateway calls (and gRPC health)"
    )
    port: int = Field(9003, ge=1, le=65535, description="the HTTP port of /health, /readiness and /metrics")
    host: str = Field("0.0.0.0", description="the address both ports listen on")
    policy: Policy = _R["policy"]
    decode_policy: Policy | None = _R["decode_policy"]
    pd_placement: Literal["remote", "two_way"] = Field(
        "remote",
        description="where a prompt is computed (docs/placement.md): remote: on the prefill the picker pairs; two_way: "
        "on the decode when the part it lacks is shorter than --placement-local-threshold (the router's cost rule "
        "learns from answers, which the EPP does not see)",
    )
    placement_local_threshold: int = _R["placement_local_threshold"]
    kv_load_tokens: int = _R["kv_load_tokens"]
    kv_host_hit_weight: float = _R["kv_host_hit_weight"]
    kv_store_hit_weight: float = _R["kv_store_hit_weight"]
    health_check_interval_s: float = _R["health_check_interval_s"]
    health_check_timeout_s: float = _R["health_check_timeout_s"]
    health_failure_threshold: int = _R["health_failure_threshold"]
    prefill_discovery: str | None = _R["prefill_discovery"]
    decode_discovery: str | None = _R["decode_discovery"]
    discovery_interval_s: float = _R["discovery_interval_s"]
    prefill_bootstrap_port: int = _R["prefill_bootstrap_port"]
    prefill_bootstrap_host: str | None = _R["prefill_bootstrap_host"]
    max_request_bytes: int = _R["max_request_bytes"]
    worker_api_key: str | None = Field(None, description="the key the EPP sends to its workers (health, metrics)")
    ssl_ca_certs: str | None = _R["ssl_ca_certs"]

    @property
    def pd(self) -> bool:
        return bool(self.prefill or self.decode or self.prefill_discovery or self.decode_discovery)

    @property
    def worker_key(self) -> str | None:
        return self.worker_api_key

    @model_validator(mode="after")
    def _one_kind(self) -> EppConfig:
        monolithic = bool(self.worker or self.worker_discovery)
        if monolithic and self.pd:
            raise ValueError("give --worker (monolithic servers) or --prefill/--decode (PD pairs), not both")
        if not monolithic and not self.pd:
            raise ValueError("give the pool: --worker URL ... (monolithic) or --prefill URL --decode URL ... (PD)")
        return self

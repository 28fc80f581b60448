"""The planner's config: every field is a `tandem planner` flag and a `TANDEM_PLANNER_*` environment variable."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class PlannerConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_PLANNER_", extra="forbid")

    router: str = Field("http://127.0.0.1:8000", description="the router whose workers the planner watches")
    mode: Literal["throughput", "latency", "sla"] = Field(
        "throughput",
        description="Dynamo's: throughput and latency hold each role's queue and KV use under thresholds (latency's "
        "are tighter); sla holds the TTFT (the observed p90, or the one the prefills' queue predicts if smaller) and the "
        "ITL (p90) under --ttft-ms and --itl-ms",
    )
    ttft_ms: float = Field(2000.0, gt=0, description="sla: the time-to-first-token target (p90, milliseconds)")
    itl_ms: float = Field(100.0, gt=0, description="sla: the inter-token latency target (p90, milliseconds)")
    interval_s: float = Field(10.0, gt=0, description="seconds between two observations and decisions")
    hysteresis: int = Field(
        3, ge=1, description="intervals in a row the same change must be wanted before the planner makes it"
    )
    cooldown_s: float = Field(30.0, ge=0, description="after a change, seconds before the next one")
    margin: float = Field(
        0.1, ge=0, lt=1, description="a change must lower the larger role pressure by this fraction at least"
    )
    min_prefill: int = Field(1, ge=0, description="the fewest prefill servers (flips and scaling keep them)")
    min_decode: int = Field(1, ge=1, description="the fewest decode servers")
    max_prefill: int = Field(16, ge=1, description="scale: the most prefill replicas")
    max_decode: int = Field(16, ge=1, description="scale: the most decode replicas")
    actuator: Literal["flip", "scale", "none"] = Field(
        "flip",
        description="flip: switch a running server's role through the router's POST /pd_role_switch (the servers "
        "run --enable-pd-role-switch); scale: set the replicas of the prefill and decode Deployments (Kubernetes); "
        "none: decide and export the decisions only",
    )
    namespace: str | None = Field(None, description="scale: the Deployments' namespace (default: the pod's own)")
    prefill_deployment: str = Field("tandem-prefill", description="scale: the prefill Deployment")
    decode_deployment: str = Field("tandem-decode", description="scale: the decode Deployment")
    host: str = "127.0.0.1"
    port: int = Field(9300, ge=0, le=65535, description="where the planner serves /metrics and /health (0: none)")
    api_key: str | None = Field(
        None, validation_alias="TANDEM_API_KEY", description="the key the router and workers want, if any"
    )

    @model_validator(mode="after")
    def _bounds(self) -> PlannerConfig:
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError("--min-prefill / --min-decode must not exceed --max-prefill / --max-decode")
        return self

"""One config object for the router process."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Policy = Literal["random", "round_robin", "power_of_two", "cache_aware"]


class PrefillSpec(BaseModel):
    url: str
    bootstrap_port: int | None = Field(None, ge=1, le=65535)


class RouterConfig(BaseModel):
    prefill: list[PrefillSpec] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    policy: Policy = "cache_aware"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    health_check_interval_s: float = Field(5.0, gt=0)
    health_failure_threshold: int = Field(2, ge=1)
    request_timeout_s: float = Field(1800.0, gt=0)
    api_key: str | None = None
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)

"""`--hicache-storage-backend-extra-config`: one JSON object, SGLang's and Mooncake's names.

    tier (every backend)    prefetch_threshold, prefetch_timeout_base, prefetch_timeout_per_ki_token (SGLang's),
                            io_timeout_s, retry_interval_s
    file                    file_path
    mooncake                master_server_address, metadata_server, protocol, device_name, global_segment_size,
                            local_buffer_size, local_hostname (as Mooncake's store config names them)

A field of another backend, an unknown field or a bad value stops the server at start-up with one line naming it.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

BACKENDS = ("file", "mooncake")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
FLAG = "--hicache-storage-backend-extra-config"
_UNITS = {"": 1, "b": 1, "kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "4GB" / "512 mb" (Mooncake's spelling)."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?b?)\s*", value.lower())
    if m is None:
        raise ValueError(f"{value!r} is not a size such as 4GB")
    return int(m.group(1)) * _UNITS[m.group(2)]


class TierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefetch_threshold: int = Field(256, ge=0, description="prefetch only when this many more tokens could hit")
    prefetch_timeout_base: float = Field(1.0, gt=0, description="--hicache-storage-prefetch-policy timeout: seconds")
    prefetch_timeout_per_ki_token: float = Field(0.25, ge=0, description="... plus this per 1024 tokens fetched")
    io_timeout_s: float = Field(5.0, gt=0, description="a store call longer than this marks the store unavailable")
    retry_interval_s: float = Field(2.0, gt=0, description="how often an unavailable store is tried again")


class FileConfig(TierConfig):
    file_path: str = "/tmp/hicache"


class MooncakeConfig(TierConfig):
    master_server_address: str = Field(min_length=1)
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    global_segment_size: int = Field(0, ge=0, description="memory this server gives the store (0: none)")
    local_buffer_size: int = Field(16 * 2**20, ge=0)
    local_hostname: str | None = None

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, value: int | str) -> int:
        return parse_size(value)


def parse_store_config(backend: str, text: str | None) -> FileConfig | MooncakeConfig:
    """The backend's config from the flag's JSON; a ValueError naming the flag and the field."""
    try:
        raw = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG}: not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG}: give a JSON object")
    model = MooncakeConfig if backend == "mooncake" else FileConfig
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(the JSON)"
        raise ValueError(f"{FLAG}: {where}: {first['msg']} (--hicache-storage-backend {backend})") from None

"""Blocking client of the bootstrap registry, used by prefill (register) and decode (lookup)."""
from __future__ import annotations

import time
from typing import Any

import httpx


def _headers(secret: str | None) -> dict[str, str]:
    return {"X-Tandem-Secret": secret} if secret else {}


def register_prefill(bootstrap_url: str, info: dict[str, Any], secret: str | None = None, timeout_s: float = 60.0) -> None:
    """PUT /route, retrying while the registry starts; raises with its error message otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.put(f"{bootstrap_url}/route", json=info, headers=_headers(secret), timeout=5)
            if r.status_code == 200:
                return
            raise RuntimeError(f"bootstrap server {bootstrap_url} refused the registration: {r.text}")
        except httpx.HTTPError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap server {bootstrap_url} unreachable for {timeout_s:.0f} s: {e}") from None
            time.sleep(0.5)


def lookup_prefill(bootstrap_url: str, engine_rank: int = 0, dp_group: int = 0, secret: str | None = None) -> dict[str, Any] | None:
    """The registered entry, or None while that rank has not registered."""
    r = httpx.get(f"{bootstrap_url}/route", params={"engine_rank": engine_rank, "target_dp_group": dp_group},
                  headers=_headers(secret), timeout=5)
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise RuntimeError(f"bootstrap server {bootstrap_url} answered {r.status_code}: {r.text}")
    return r.json()

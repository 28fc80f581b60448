"""Blocking client of the bootstrap registry, used by prefill (register) and decode (lookup)."""

from __future__ import annotations

import time
from typing import Any

import httpx


def _headers(secret: str | None) -> dict[str, str]:
    return {"X-Tandem-Secret": secret} if secret else {}


def register_prefill(
    bootstrap_url: str, info: dict[str, Any], secret: str | None = None, timeout_s: float = 60.0
) -> None:
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


def lookup_prefill(
    bootstrap_url: str, instance_id: str | None = None, secret: str | None = None, client: httpx.Client | None = None
) -> dict[str, Any] | None:
    """The entry of prefill `instance_id` (None: of the registry's only rank-0 instance), or None while it
    has not registered; RuntimeError naming the registry's answer otherwise. `client`: a keep-alive
    client to ask through (default: a new connection)."""
    params = {"instance_id": instance_id} if instance_id else {"engine_rank": 0, "target_dp_group": 0}
    r = (client or httpx).get(f"{bootstrap_url}/route", params=params, headers=_headers(secret), timeout=5)
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise RuntimeError(f"bootstrap server {bootstrap_url} answered {r.status_code}: {message}")
    return r.json()

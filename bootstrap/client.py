"""Blocking client of the bootstrap registry, used by prefill (register) and decode (lookup). With a cluster
secret every request is signed (bootstrap/signing.py); an https:// registry is verified against `verify`
(a CA bundle path, or True for the system's)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from bootstrap.signing import SIGNATURE_HEADER, sign
from common.edge.tls import client_verify


def send_signed(
    client: httpx.Client, method: str, url: str, secret: str | None, params: dict | None = None, body: Any = None
) -> httpx.Response:
    """One request through `client`, signed over its exact path, query and body when there is a secret."""
    content = b"" if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"} if body is not None else {}
    request = client.build_request(method, url, params=params, content=content, headers=headers)
    if secret:
        request.headers[SIGNATURE_HEADER] = sign(secret, method, request.url.raw_path.decode("ascii"), content)
    return client.send(request)  # an http:// URL of a TLS registry: a 400 saying "use https://"


def register_prefill(
    bootstrap_url: str,
    info: dict[str, Any],
    secret: str | None = None,
    timeout_s: float = 60.0,
    verify: str | bool = True,
) -> None:
    """PUT /route, retrying while the registry starts; raises with its error message otherwise."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5, verify=client_verify(verify)) as client:
        while True:
            try:
                r = send_signed(client, "PUT", f"{bootstrap_url}/route", secret, body=info)
                if r.status_code == 200:
                    return
                raise RuntimeError(f"bootstrap server {bootstrap_url} refused the registration: {r.text}")
            except httpx.HTTPError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"bootstrap server {bootstrap_url} unreachable for {timeout_s:.0f} s: {e}"
                    ) from None
                time.sleep(0.5)


def lookup_prefill(
    bootstrap_url: str, instance_id: str | None = None, secret: str | None = None, client: httpx.Client | None = None
) -> dict[str, Any] | None:
    """The entry of prefill `instance_id` (None: of the registry's only rank-0 instance), or None while it
    has not registered; RuntimeError naming the registry's answer otherwise. `client`: a keep-alive
    client to ask through (default: a new connection, verified against the system's CAs)."""
    params = {"instance_id": instance_id} if instance_id else {"engine_rank": 0, "target_dp_group": 0}
    if client is None:
        with httpx.Client(timeout=5) as own:
            return lookup_prefill(bootstrap_url, instance_id, secret, own)
    r = send_signed(client, "GET", f"{bootstrap_url}/route", secret, params=params)
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise RuntimeError(f"bootstrap server {bootstrap_url} answered {r.status_code}: {message}")
    return r.json()

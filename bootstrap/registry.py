"""The bootstrap registry's state: prefill instances and where their control planes listen, keyed by
instance id (a restarted prefill is a new instance), so several prefills can share one registry and each
decode finds the one the router paired it with. Entries that stop re-registering expire.

Lookups: by instance id (what the router passes), or by (engine_rank, dp_group) as SGLang's decode does,
which is only unambiguous while one instance holds that rank.

DP ranks: a prefill with DP attention registers one entry per DP rank (`dp_rank` of `dp_size`; every rank
reached through the instance's one control endpoint). A lookup by instance id answers its DP rank 0's entry
with `dp_ranks`, the DP ranks registered; a decode pairs only once all of them are.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from bootstrap.signing import SIGNATURE_HEADER, SignatureError, SignatureGuard
from common.wire.kv_layout import LAYOUT_KEYS

FIELDS: dict[str, tuple[type, ...]] = {
    "role": (str,),
    "tp_size": (int,),
    "tp_rank": (int,),
    "dp_size": (int,),
    "dp_rank": (int,),
    "rank_ip": (str,),
    "rank_port": (int,),
    "page_size": (int,),
    "num_layers": (int,),
    "kv_heads": (int,),
    "head_dim": (int,),
    "dtype": (str,),
    "transfer_backend": (str,),
    "instance_id": (str,),
    "model_id": (str,),
    "attention": (str,),
    "kv_scales": (str,),
    "kv_checksum": (bool,),
    "speculative": (str,),
    "experts": (str,),
    "weights": (str,),
    "deterministic": (bool,),
}
DEFAULTS = {
    "dp_size": 1,
    "dp_rank": 0,
    "instance_id": "",
    "kv_checksum": False,
    "speculative": "none",
    "experts": "",
    "weights": "none",
    "deterministic": False,
}
SIZES = ("tp_size", "dp_size", "page_size", "num_layers", "kv_heads", "head_dim")
MAX_STRING = 255
MAX_BODY_BYTES = 64 * 1024
RANK_QUERY = re.compile(r"-?[0-9]{1,18}")  # a plain decimal: int() alone also takes " 1", "1_0", "١"
ENTRY_TTL_S = 60.0  # prefills re-register every heartbeat interval (at most every 15 s); older entries expire
MAX_INSTANCES = 4096


class RegistrationError(ValueError):
    """A request the registry refuses; `field` names the part of it at fault."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


def validate_registration(body: Any) -> dict[str, Any]:
    """The registry entry of a PUT /route body, or RegistrationError naming the first bad field."""
    if not isinstance(body, dict):
        raise RegistrationError("body", "must be a JSON object")
    entry = DEFAULTS | {k: v for k, v in body.items() if k in FIELDS}
    for name, types in FIELDS.items():
        _check_type(name, entry.get(name), types)
    if entry["role"] != "Prefill":
        raise RegistrationError("role", "only 'Prefill' ranks register")
    if not 1 <= entry["rank_port"] <= 65535:
        raise RegistrationError("rank_port", "must be in 1..65535")
    for name in SIZES:
        if entry[name] < 1:
            raise RegistrationError(name, "must be >= 1")
    for rank, size in (("tp_rank", "tp_size"), ("dp_rank", "dp_size")):
        if not 0 <= entry[rank] < entry[size]:
            raise RegistrationError(rank, f"must be in 0..{size} - 1")
    if not entry["rank_ip"]:
        raise RegistrationError("rank_ip", "must be a host name or address")
    return entry


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if value is None:
        raise RegistrationError(name, "is required")
    if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
        raise RegistrationError(name, f"must be {types[0].__name__}")
    if isinstance(value, str) and len(value) > MAX_STRING:
        raise RegistrationError(name, f"must be at most {MAX_STRING} characters")


def parse_ranks(query: Any) -> tuple[int, int]:
    """(engine_rank, target_dp_group) of a GET/DELETE /route query; both default to 0."""
    ranks = []
    for name in ("engine_rank", "target_dp_group"):
        raw = query.get(name, "0")
        if not RANK_QUERY.fullmatch(raw):
            raise RegistrationError(name, "must be an integer")
        ranks.append(int(raw))
    if ranks != [-1, -1] and min(ranks) < 0:
        raise RegistrationError(
            "engine_rank" if ranks[0] < 0 else "target_dp_group", "must be >= 0 (or both -1 for the layout)"
        )
    return ranks[0], ranks[1]


class Registry:
    """The registered prefill instances, the guard of the cluster secret's signatures and what was rejected
    (also as Prometheus metrics). Used from one event loop; `clock` is injectable for tests."""

    def __init__(self, secret: str | None, clock: Callable[[], float] = time.monotonic):
        self.guard = SignatureGuard(secret) if secret else None  # empty: no secret, as for control frames
        self.clock = clock
        self.entries: dict[tuple[str, int], dict[str, Any]] = {}  # (instance key, DP rank) -> entry
        self._seen: dict[tuple[str, int], float] = {}  # (instance key, DP rank) -> when it last registered
        self.rejected = 0  # all rejected requests, read by an embedding prefill server's /metrics
        self.metrics = CollectorRegistry()
        self.rejected_registrations = Counter(
            "tandem_bootstrap_rejected_registrations",
            "PUT /route requests rejected, by the field at fault",
            ["field"],
            registry=self.metrics,
        )
        self.rejected_lookups = Counter(
            "tandem_bootstrap_rejected_lookups",
            "GET and DELETE /route requests rejected, by method and field at fault",
            ["method", "field"],
            registry=self.metrics,
        )
        Gauge("tandem_bootstrap_registered_ranks", "prefill instances registered", registry=self.metrics).set_function(
            lambda: len(self.live_entries())
        )

    def register(self, entry: dict[str, Any]) -> bool:
        """Add or refresh an instance; True when it is new or changed (worth a log line)."""
        key = (instance_key(entry), entry["dp_rank"])
        self.expire()
        if key not in self.entries and len(self.entries) >= MAX_INSTANCES:
            raise RegistrationError("instance_id", f"the registry holds {MAX_INSTANCES} instances already", 503)
        news = self.entries.get(key) != entry
        self.entries[key] = entry
        self._seen[key] = self.clock()
        return news

    def live_entries(self) -> list[dict[str, Any]]:
        self.expire()
        return list(self.entries.values())

    def expire(self) -> None:
        now = self.clock()
        for key in [k for k, t in self._seen.items() if now - t > ENTRY_TTL_S]:
            del self.entries[key], self._seen[key]

    def by_instance(self, instance_id: str) -> dict[str, Any] | None:
        """Its DP rank 0's entry, with `dp_ranks`: the DP ranks it registered."""
        self.expire()
        ranks = sorted(d for key, d in self.entries if key == instance_id)
        if 0 not in ranks:
            return None
        return self.entries[(instance_id, 0)] | {"dp_ranks": ranks}

    def by_rank(self, rank: int, dp: int) -> dict[str, Any] | None:
        """The one instance holding this rank; RegistrationError (409) when several do."""
        found = [e for e in self.live_entries() if (e["tp_rank"], e["dp_rank"]) == (rank, dp)]
        if len(found) > 1:
            ids = ", ".join(sorted(instance_key(e) for e in found))
            raise RegistrationError(
                "instance_id",
                f"{len(found)} prefill instances hold rank {rank} of dp group {dp} "
                f"({ids}): name one with instance_id (routers send prefill_instance_id)",
                409,
            )
        return found[0] if found else None

    def layout(self) -> dict[str, Any] | None:
        entries = self.live_entries()
        return {k: entries[0][k] for k in ("tp_size", "dp_size", *LAYOUT_KEYS)} if entries else None

    def remove(self, instance_id: str | None, ranks: tuple[int, int]) -> None:
        for key, e in list(self.entries.items()):
            if e["instance_id"] == instance_id if instance_id else (e["tp_rank"], e["dp_rank"]) == ranks:
                del self.entries[key], self._seen[key]

    def check_signature(self, request: web.Request, body: bytes = b"") -> None:
        """RegistrationError (401) unless the request is signed with the cluster secret (bootstrap/signing.py)."""
        if self.guard is None:
            return
        try:
            self.guard.check(request.headers.get(SIGNATURE_HEADER), request.method, request.raw_path, body)
        except SignatureError as e:
            raise RegistrationError("signature", str(e), 401) from None

    def count_rejection(self, method: str, field: str) -> None:
        self.rejected += 1
        if method == "PUT":
            self.rejected_registrations.labels(field).inc()
        else:
            self.rejected_lookups.labels(method, field).inc()


def instance_key(entry: dict[str, Any]) -> str:
    """An instance's key: its id, or where its control plane listens when it sent none."""
    return entry["instance_id"] or f"{entry['rank_ip']}:{entry['rank_port']}"


def parse_instance(query: Any) -> str | None:
    raw = query.get("instance_id")
    if raw is not None and not 0 < len(raw) <= MAX_STRING:
        raise RegistrationError("instance_id", f"must be 1..{MAX_STRING} characters")
    return raw

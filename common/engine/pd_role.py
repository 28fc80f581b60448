"""What the two PD roles (prefill_node/role.py, decode_node/role.py) share: the KV manager each owns, the
transfer identity /get_server_info shows, the manager's health, and what the composer adds to close()."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from common.engine.role import Role


class KVManagerHandle(Protocol):
    """What the roles' shared half reads of their KV manager (transfer/manager.py's KVManager)."""

    instance_id: str
    endpoint: str

    def close(self) -> None: ...

    def health_problem(self) -> str | None: ...


class PDRole(Role):
    """A role over a KV manager: it reports the manager's identity and health and closes it, then runs
    `on_close` (what the composer adds: its threads' stop, the transfer metrics' removal)."""

    def __init__(self, kv_manager: KVManagerHandle):
        self.kv_manager = kv_manager
        self.instance_id = kv_manager.instance_id
        self.on_close: list[Callable[[], None]] = []

    def info(self) -> dict[str, Any]:
        return {
            "instance_id": self.kv_manager.instance_id,
            "control_endpoint": self.kv_manager.endpoint,
            **self.queue_depths(),
        }

    def close(self) -> None:
        self.kv_manager.close()
        for fn in self.on_close:
            fn()

    def health_problem(self) -> str | None:
        return self.kv_manager.health_problem()

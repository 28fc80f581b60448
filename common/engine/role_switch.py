"""A PD server's role switch (--enable-pd-role-switch, `POST /pd_role_switch`, SGLang's names; docs/placement.md):
a prefill becomes a decode, or back, in the same process, with the same weights, KV pool and prefix cache.

    serving --switch(new role)--> draining: /health and new generations answer 503 with X-Tandem-Draining (a router
        takes the server out of rotation without ending what runs on it, and retries a refused request on
        another pair); what is in flight finishes. Past --pd-role-switch-timeout-s the switch is given up and the
        old role serves on: no request fails either way.
      --(idle: no request in a queue of the scheduler or the role, no generation in the HTTP layer)-->
        the old role removed from the scheduler and closed (its transfer instance, control plane and threads; a
        prefill stops re-registering), the new one built (a new instance id; a prefill registers with its
        bootstrap registry) and installed --> serving, as the new role

The transfer engine and its registered memory stay (transfer/backends/shared.py). The prefix cache stays: its pages
hold the same model's KV whichever role computed them. Who frees what: nothing is freed here, as the switch runs
only once no request holds a row, a page or a room (`Scheduler.check_integrity` runs before the old role goes).
A new role that cannot be built (its bootstrap registry unreachable) is undone: the old role's kind is built again;
if that fails too, /health names the failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from common.config import ServerConfig
from common.engine.role import Role, RoleContext, RoleFactory
from common.engine.scheduler import Scheduler
from common.engine.scheduler_thread import on_scheduler_thread

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.05


class SwitchRefused(Exception):
    """A switch that cannot start or did not happen; `status` is the HTTP answer's."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def bootstrap_address(config: ServerConfig, mode: str) -> str | None:
    """HOST:PORT of the bootstrap registry a prefill registers with (its embedded one, or --bootstrap-url's);
    None for other roles."""
    if mode != "prefill":
        return None
    if config.bootstrap_url:
        return config.bootstrap_url.split("://", 1)[-1].rstrip("/")
    return f"{config.public_host}:{config.bootstrap_port}"


class RoleSwitch:
    def __init__(
        self,
        scheduler: Scheduler,
        context: RoleContext,
        factories: dict[str, RoleFactory],
        on_switched: Callable[[str], None],
    ):
        """`scheduler`: whose role is replaced (a switchable server has one); `factories`: how to build each role
        from `context` (prefill_node/compose.py, decode_node/compose.py); `on_switched(mode)`: a role of `mode`
        was installed (on the scheduler thread)."""
        self.scheduler, self.context, self.factories, self.on_switched = scheduler, context, factories, on_switched
        self.mode = context.config.disaggregation_mode  # the role served now
        self.state = "serving"  # serving | draining | switching
        self.target: str | None = None
        self.generating = 0  # generation requests in the HTTP layer (common/http/switch_guard.py counts them)
        self.problem: str | None = None  # a failed switch that could not be undone: /health answers 503 with it

    @property
    def refusing(self) -> bool:
        """Whether new work is refused (the switch is under way)."""
        return self.state != "serving"

    async def switch(self, new_role: str) -> dict[str, Any]:
        """Switch to `new_role` once what runs has finished; what the endpoint answers (SGLang's fields)."""
        old = self.mode
        if new_role not in self.factories:
            raise SwitchRefused(400, f"new_role must be prefill or decode, not {new_role!r}")
        if self.state != "serving":
            raise SwitchRefused(409, f"a switch to {self.target} is already in progress")
        if self.problem is not None:
            raise SwitchRefused(503, f"an earlier switch failed and left no role: {self.problem}; restart the server")
        if new_role == old:
            return self._answer(old, new_role, "already in target role")
        self.state, self.target, start = "draining", new_role, time.monotonic()
        log.info("switching role %s -> %s: taking no new work, waiting for what runs", old, new_role)
        try:
            await self._wait_idle()
            self.state = "switching"
            await self._replace(new_role)
        finally:
            self.state, self.target = "serving", None
        log.info("switched role %s -> %s in %.1f s (instance %s)", old, new_role, time.monotonic() - start,
                 self.scheduler.role.instance_id)  # fmt: skip
        return self._answer(old, new_role, "ok")

    async def _wait_idle(self) -> None:
        timeout = self.context.config.pd_role_switch_timeout_s
        deadline = time.monotonic() + timeout
        while not (self.generating == 0 and await self._on_scheduler(self.scheduler.idle)):
            if time.monotonic() > deadline:
                raise SwitchRefused(
                    503,
                    f"requests were still in flight after {timeout:g} s (--pd-role-switch-timeout-s); "
                    f"the role stays {self.mode}",
                )
            await asyncio.sleep(IDLE_POLL_S)

    async def _replace(self, new_role: str) -> None:
        """Out with the old role, in with a new one of `new_role` (or, failing that, of the old kind again)."""
        old_mode = self.mode
        old = await self._on_scheduler(lambda: self._install(Role(), "null"))
        await asyncio.to_thread(old.close)
        try:
            role = await asyncio.to_thread(self._build, new_role)
        except Exception as e:
            log.exception("building the %s role failed; building the %s role again", new_role, old_mode)
            try:
                role = await asyncio.to_thread(self._build, old_mode)
            except Exception as again:
                self.problem = f"building the {new_role} role failed ({e!r}), and the {old_mode} role again ({again!r})"
                raise SwitchRefused(500, self.problem) from again
            await self._on_scheduler(lambda: self._install(role, old_mode))
            raise SwitchRefused(500, f"building the {new_role} role failed: {e!r}; the role stays {old_mode}") from e
        await self._on_scheduler(lambda: self._install(role, new_role))

    def _build(self, mode: str) -> Role:
        """The new role: one, as a switchable server runs at --tp-size 1 (one DP rank)."""
        [role] = self.factories[mode](self.context)
        return role

    def _install(self, role: Role, mode: str) -> Role:
        """On the scheduler thread: `role` serves from the next step on; returns the one it replaced."""
        s = self.scheduler
        if not s.idle():
            raise RuntimeError("a request reached the scheduler during a role switch")
        s.check_integrity()
        old, s.role = s.role, role
        self.mode = mode
        self.on_switched(mode)
        return old

    async def _on_scheduler(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(on_scheduler_thread(self.scheduler, fn))

    def _answer(self, old: str, new: str, message: str) -> dict[str, Any]:
        return {
            "success": True,
            "message": message,
            "old_role": old,
            "new_role": new,
            "instance_id": self.scheduler.role.instance_id,
            "bootstrap": bootstrap_address(self.context.config, self.mode),
        }

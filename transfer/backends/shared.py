"""One transfer engine for the life of a process whose PD role switches (--enable-pd-role-switch): each role's KV
manager is new (a new instance, control plane and room table), the engine and what it registered are not.

A range is registered once (the KV pool, the decode's aux buffer), whichever role registers it first; `close()`,
which a role's manager calls when the role ends, does nothing: `shutdown()` ends the engine with the process.
"""

from __future__ import annotations

from collections.abc import Callable

from transfer.backends.base import TransferBackend


class SharedBackend(TransferBackend):
    def __init__(self) -> None:
        self.inner: TransferBackend | None = None
        self.registered: set[tuple[int, int]] = set()

    def bind(self, make: Callable[[], TransferBackend]) -> SharedBackend:
        """Itself, the engine made by `make` on the first call (later calls keep the first engine)."""
        if self.inner is None:
            self.inner = make()
        return self

    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        if (ptr, nbytes) not in self.registered:
            self.inner.register(ptr, nbytes, on_device)
            self.registered.add((ptr, nbytes))

    def address(self) -> bytes:
        return self.inner.address()

    # the rest is the engine's own, whatever its arguments (TransferBackend's)
    def add_peer(self, *args, **kwargs) -> None:
        self.inner.add_peer(*args, **kwargs)

    def write_batch(self, *args, **kwargs) -> None:
        self.inner.write_batch(*args, **kwargs)

    def close(self) -> None:
        """A role ended; the engine stays for the next one."""

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def describe(self) -> str:
        return self.inner.describe() + " (kept across role switches)"

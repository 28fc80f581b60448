"""In-process memmove: for unit tests of everything above the data plane. Never a server default."""

from __future__ import annotations

import ctypes

from transfer.backends.base import TransferBackend


class LoopbackBackend(TransferBackend):
    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        pass

    def describe(self) -> str:
        return "loopback (in-process memmove)"

    def address(self) -> bytes:
        return b"loopback"

    def add_peer(self, peer_id: str, address: bytes, device_index: int = 0) -> None:
        if address != b"loopback":
            raise ValueError("the loopback backend only reaches its own process")

    def write_batch(
        self, peer_id: str, src: list[int], dst: list[int], nbytes: list[int], on_device: bool = False
    ) -> None:
        for s, d, n in zip(src, dst, nbytes):
            ctypes.memmove(d, s, n)

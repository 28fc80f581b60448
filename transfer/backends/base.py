"""The data-plane seam: register memory, learn peers, write batches of (src, dst, nbytes)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from common.wire.user_error import UserError


class TransportUnavailable(UserError):
    """The transfer engine cannot move KV the way the flags ask (a transport it lacks); the message says
    which one is missing and what to change. Raised at start-up, before the server answers /health."""


class TransferBackend(ABC):
    @abstractmethod
    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        """Make [ptr, ptr + nbytes) readable/writable by peers (on_device: GPU memory)."""

    @abstractmethod
    def address(self) -> bytes:
        """What a peer needs (via add_peer) to write to us."""

    @abstractmethod
    def add_peer(self, peer_id: str, address: bytes, device_index: int = 0) -> None:
        """Learn how to reach a peer whose registered KV lives on CUDA device `device_index` (its own
        index, on its host); idempotent."""

    @abstractmethod
    def write_batch(
        self, peer_id: str, src: list[int], dst: list[int], nbytes: list[int], on_device: bool = False
    ) -> None:
        """Copy every src range into the peer's dst range and return when all have landed; raise on
        failure. Any number of pieces: the backend splits them as its engine requires.
        on_device: both sides are GPU memory (KV on CUDA) rather than host memory (aux records)."""

    def close(self) -> None:
        """Release engine resources."""

    @abstractmethod
    def describe(self) -> str:
        """Which engine and transport move the bytes, for the start-up log."""

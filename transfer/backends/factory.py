"""Which transfer backend moves a server's KV (--transfer-backend, one of common.wire.kv_layout.TRANSFER_BACKENDS):
Mooncake's Transfer Engine or NIXL, each imported only when chosen; the loopback memmove for unit tests."""

from __future__ import annotations

from common.wire.kv_layout import LOOPBACK_BACKEND, TRANSFER_BACKENDS
from transfer.backends.base import TransferBackend


def make_backend(
    name: str,
    host: str,
    protocol: str = "tcp",
    device: str = "",
    timeout_s: float = 60.0,
    on_cuda: bool = False,
    device_index: int = 0,
) -> TransferBackend:
    """`timeout_s` bounds one write_batch call: it raises instead of waiting longer on a stuck peer;
    `device_index`: the CUDA device of the KV pool (NIXL names it in every descriptor)."""
    if name == "mooncake":
        from transfer.backends.mooncake import MooncakeBackend

        return MooncakeBackend(host, protocol, device, timeout_s)
    if name == "nixl":
        from transfer.backends.nixl import NixlBackend

        return NixlBackend(timeout_s, protocol, on_cuda, device_index)
    if name == LOOPBACK_BACKEND:
        from transfer.backends.loopback import LoopbackBackend

        return LoopbackBackend()
    raise ValueError(f"unknown transfer backend {name!r}; choose {' or '.join(TRANSFER_BACKENDS)}")

"""Mooncake Transfer Engine: RDMA when asked for (`--transfer-protocol rdma`), TCP otherwise.

initialize() takes positional arguments only; peers are named by their session id "host:rpc_port".

Its Python initialize() discovers the topology and installs transports from what it finds, whatever the
protocol argument says: RDMA when it sees an HCA, TCP when it sees none, and with MC_INTRANODE_NVLINK set an
NVLink transport that refuses host memory. So the transport is chosen here, before initialize, from what
this server registers (the KV pool, on the device or the host, and always the aux records in host memory):
TCP is forced (MC_FORCE_TCP) when TCP is asked for; RDMA must find a device, else start-up fails naming
the flags; NVLink is refused when host memory is registered (the aux records would be unreachable).
`describe()` says at start-up which transport the engine uses.

On GPUs NIXL is the path (docs/gpu.md): with the aux records in host memory Mooncake cannot use NVLink,
and its TCP transport moves device memory through the host in 64 KiB synchronous cudaMemcpy pieces on the
default stream, which stalls both sides' compute. Over RDMA (GPUDirect) it reaches both memories.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

from transfer.backends.base import TransferBackend, TransportUnavailable

os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake logs every connection at INFO
# The TCP transport queues this many pieces per peer (its default, 1024, fails the rest of a larger
# batch at once; one chunk of fragmented pages is thousands of pieces). 65535 is its upper bound. One
# thread writes to a given decode (its TransferWorker), so one batch never shares the queue.
MAX_PIECES_PER_PEER = 65535
NVLINK_ENV = "MC_INTRANODE_NVLINK"


def discovered_hcas(topology: str) -> list[str]:
    """The RDMA devices in Mooncake's topology JSON ({"cpu:0": [[preferred], [available]], ...})."""
    found: dict[str, None] = {}
    for lists in json.loads(topology or "{}").values():
        for hcas in lists:
            found.update(dict.fromkeys(hcas))
    return list(found)


def nvlink_requested(env: Mapping[str, str]) -> bool:
    return env.get(NVLINK_ENV, "").lower() in ("1", "true", "yes", "on")


def check_transport(protocol: str, hcas: list[str], env: Mapping[str, str]) -> str:
    """The transport the engine uses after initialize, described; TransportUnavailable when it is not the
    one asked for."""
    if nvlink_requested(env):
        return "nvlink (within one host, device memory only)"
    if protocol == "rdma" and env.get("MC_FORCE_TCP"):
        raise TransportUnavailable(
            "--transfer-protocol rdma, but MC_FORCE_TCP is set in the environment (Mooncake would use TCP): "
            "unset it, or use --transfer-protocol tcp"
        )
    if protocol == "rdma" and not hcas:
        raise TransportUnavailable(
            "--transfer-protocol rdma: Mooncake found no RDMA device on this host (no HCA in its topology); "
            "check the RDMA drivers and the device plugin, name the devices with --transfer-device, "
            "or use --transfer-protocol tcp"
        )
    return f"rdma over {','.join(hcas)}" if protocol == "rdma" else "tcp"


class MooncakeBackend(TransferBackend):
    def __init__(self, host: str, protocol: str = "tcp", device: str = "", timeout_s: float = 60.0):
        # Read once by the engine: bounds each synchronous batch write (plus 1 s per GiB moved).
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(timeout_s)))
        os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(MAX_PIECES_PER_PEER)
        if protocol == "tcp" and not nvlink_requested(os.environ):
            os.environ["MC_FORCE_TCP"] = "1"  # else an HCA on the host silently makes it RDMA
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed with {rc}"
            )
        self.transport = check_transport(protocol, discovered_hcas(self.engine.get_local_topology()), os.environ)
        self._address = f"{host}:{self.engine.get_rpc_port()}".encode()
        self.sessions: dict[str, str] = {}

    def describe(self) -> str:
        return f"Mooncake, transport {self.transport}"

    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        if not on_device and self.transport.startswith("nvlink"):
            raise TransportUnavailable(
                f"{NVLINK_ENV} is set: Mooncake's NVLink transport cannot reach host memory, where the aux "
                f"records live; unset {NVLINK_ENV} (the KV then moves over --transfer-protocol tcp or rdma)"
            )
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({nbytes} bytes) failed with {rc}")

    def address(self) -> bytes:
        return self._address

    def add_peer(self, peer_id: str, address: bytes, device_index: int = 0) -> None:
        # the segment's own metadata (fetched at the handshake) names its buffers' devices
        self.sessions[peer_id] = address.decode()

    def write_batch(
        self, peer_id: str, src: list[int], dst: list[int], nbytes: list[int], on_device: bool = False
    ) -> None:
        # The sync call polls for completion in C++ without ever sleeping (GIL released): the Python API
        # has no non-blocking status for a whole batch (transfer_check_status sees its first piece only).
        session = self.sessions[peer_id]
        for i in range(0, len(src), MAX_PIECES_PER_PEER):
            end = i + MAX_PIECES_PER_PEER
            rc = self.engine.batch_transfer_sync_write(session, src[i:end], dst[i:end], nbytes[i:end])
            if rc < 0:
                raise RuntimeError(f"Mooncake batch write of {len(src[i:end])} pieces to {session} failed with {rc}")

"""Mooncake Transfer Engine: RDMA when asked for (`--transfer-protocol rdma`), TCP otherwise.

initialize() takes positional arguments only; peers are named by their session id "host:rpc_port".
Intra-node NVLink on CUDA builds is MC_INTRANODE_NVLINK=true (never protocol "nvlink" on x86).
"""

from __future__ import annotations

import math
import os

from transfer.backends.base import TransferBackend

os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake logs every connection at INFO
# The TCP transport queues this many pieces per peer (its default, 1024, fails the rest of a larger
# batch at once; one chunk of fragmented pages is thousands of pieces). 65535 is its upper bound. One
# thread writes to a given decode (its TransferWorker), so one batch never shares the queue.
MAX_PIECES_PER_PEER = 65535


class MooncakeBackend(TransferBackend):
    def __init__(self, host: str, protocol: str = "tcp", device: str = "", timeout_s: float = 60.0):
        # Read once by the engine: bounds each synchronous batch write (plus 1 s per GiB moved).
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(timeout_s)))
        os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(MAX_PIECES_PER_PEER)
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed with {rc}"
            )
        self._address = f"{host}:{self.engine.get_rpc_port()}".encode()
        self.sessions: dict[str, str] = {}

    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({nbytes} bytes) failed with {rc}")

    def address(self) -> bytes:
        return self._address

    def add_peer(self, peer_id: str, address: bytes) -> None:
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

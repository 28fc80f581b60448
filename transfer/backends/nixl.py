"""NIXL with its UCX backend (UCX_TLS picks tcp / cuda_ipc / rc). Peers exchange agent metadata over
the control plane. A process that created a UCX agent can crash at interpreter exit: servers leave
through os._exit after close()."""
from __future__ import annotations

import time
import uuid

from transfer.backends.base import TransferBackend


class NixlBackend(TransferBackend):
    def __init__(self, timeout_s: float = 60.0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.timeout_s = timeout_s
        self.name = f"tandem-{uuid.uuid4().hex[:12]}"
        # several threads use the agent: one transfer worker per decode peer, and the control thread
        config = nixl_agent_config(backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self.agent = nixl_agent(self.name, config)
        self.device_id = 0
        self.peers: dict[str, str] = {}
        self._registered = []

    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        descs = self.agent.get_reg_descs([(ptr, nbytes, self.device_id, "")], "VRAM" if on_device else "DRAM")
        self._registered.append(self.agent.register_memory(descs))

    def address(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, peer_id: str, address: bytes) -> None:
        if peer_id not in self.peers:
            self.peers[peer_id] = self.agent.add_remote_agent(address)

    def write_batch(self, peer_id: str, src: list[int], dst: list[int], nbytes: list[int], on_device: bool = False) -> None:
        if not src:
            return
        mem = "VRAM" if on_device else "DRAM"
        local = self.agent.get_xfer_descs([(s, n, self.device_id) for s, n in zip(src, nbytes)], mem)
        remote = self.agent.get_xfer_descs([(d, n, self.device_id) for d, n in zip(dst, nbytes)], mem)
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.peers[peer_id], b"")
        try:
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer could not start")
            deadline = time.monotonic() + self.timeout_s
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL transfer of {len(src)} pieces did not finish in {self.timeout_s:g} s")
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in state {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        for reg in self._registered:
            self.agent.deregister_memory(reg)
        self._registered = []

"""NIXL with its UCX backend (UCX_TLS picks tcp / cuda_ipc / rc). Peers exchange agent metadata over
the control plane. A process that created a UCX agent can crash at interpreter exit: servers leave
through os._exit after close().

On CUDA, UCX moves device memory only with its CUDA transports: unless the operator set UCX_TLS, it is
set to cuda_ipc (GPU to GPU on one host), cuda_copy (staging) and the network transport of
--transfer-protocol (rc for RDMA, tcp), plus sm and self for the host-memory aux records. A descriptor
names the device its memory is on: local ones this process's pool (cuda:N, not device 0), remote ones the
peer's, as its Register said (per-rank engines: a pair of ranks may sit on different GPU indices)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping

import numpy as np

from transfer.backends.base import TransferBackend

# The UCX progress thread sleeps in poll() on the worker's event fd and wakes on every event; this is
# only its fallback wake-up. nixl_agent hard-codes 0, and poll(0) spins one core per process forever.
PROGRESS_WAKEUP_US = 1000
# Waiting for a transfer: look at once, then sleep, doubling the pause up to the cap. A pause is about
# as long as the wait so far, so a wait ends within about twice the transfer's time and 1 ms after it.
FIRST_PAUSE_S, MAX_PAUSE_S = 20e-6, 1e-3


log = logging.getLogger(__name__)


def ucx_transports(protocol: str, on_cuda: bool, env: Mapping[str, str]) -> str | None:
    """The UCX_TLS a server sets, or None to leave UCX's choice (the operator set it, or host memory only)."""
    if "UCX_TLS" in env or not on_cuda:
        return None
    return f"cuda_ipc,cuda_copy,{'rc' if protocol == 'rdma' else 'tcp'},sm,self"


def _make_agent(name: str):
    """A nixl_agent with a UCX backend whose progress thread sleeps between events (see
    PROGRESS_WAKEUP_US). The wrapper has no setting for that delay, so it is created without backends,
    given a core agent built with the delay, and only then asked for UCX."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    from nixl._bindings import nixlAgent, nixlAgentConfig

    # several threads use the agent: one transfer worker per decode peer, and the control thread
    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
    agent = nixl_agent(name, nixl_agent_config(backends=[], sync_mode=sync))
    config = nixlAgentConfig()
    config.useProgThread, config.syncMode, config.pthrDelay = True, sync.value, PROGRESS_WAKEUP_US
    agent.agent = nixlAgent(name, config)
    agent.create_backend("UCX")
    return agent


def _descs(addrs, nbytes, device_id: int) -> np.ndarray:
    """The Nx3 (address, length, device) array NIXL turns into a descriptor list in one C++ call."""
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, nbytes, device_id
    return out


class NixlBackend(TransferBackend):
    def __init__(self, timeout_s: float = 60.0, protocol: str = "tcp", on_cuda: bool = False, device_id: int = 0):
        self.timeout_s = timeout_s
        tls = ucx_transports(protocol, on_cuda, os.environ)
        if tls is not None:
            os.environ["UCX_TLS"] = tls  # read when the UCX backend is created, just below
        self.name = f"tandem-{uuid.uuid4().hex[:12]}"
        self.agent = _make_agent(self.name)
        self.device_id = device_id  # the KV pool's CUDA device; 0 (ignored by UCX) for host memory
        self.peers: dict[str, tuple[str, int]] = {}  # peer id -> (remote agent name, its KV's device)
        self._registered = []

    def register(self, ptr: int, nbytes: int, on_device: bool = False) -> None:
        descs = self.agent.get_reg_descs([(ptr, nbytes, self.device_id, "")], "VRAM" if on_device else "DRAM")
        self._registered.append(self.agent.register_memory(descs))

    def describe(self) -> str:
        tls = os.environ.get("UCX_TLS", "UCX's default")
        return f"NIXL over UCX, UCX_TLS={tls}, KV descriptors on device {self.device_id}"

    def address(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, peer_id: str, address: bytes, device_index: int = 0) -> None:
        if peer_id not in self.peers:
            self.peers[peer_id] = (self.agent.add_remote_agent(address), device_index)

    def write_batch(
        self, peer_id: str, src: list[int], dst: list[int], nbytes: list[int], on_device: bool = False
    ) -> None:
        if not src:
            return
        mem = "VRAM" if on_device else "DRAM"
        agent, remote_device = self.peers[peer_id]
        local = self.agent.get_xfer_descs(_descs(src, nbytes, self.device_id if on_device else 0), mem)
        remote = self.agent.get_xfer_descs(_descs(dst, nbytes, remote_device if on_device else 0), mem)
        handle = self.agent.initialize_xfer("WRITE", local, remote, agent)
        try:
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer could not start")
            self._wait(handle, len(src))
        finally:
            self.agent.release_xfer_handle(handle)

    def _wait(self, handle, pieces: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = FIRST_PAUSE_S
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL transfer of {pieces} pieces did not finish in {self.timeout_s:g} s")
            time.sleep(pause)  # the progress thread moves the data meanwhile; this thread only looks
            pause = min(2 * pause, MAX_PAUSE_S)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")

    def close(self) -> None:
        for reg in self._registered:
            self.agent.deregister_memory(reg)
        self._registered = []

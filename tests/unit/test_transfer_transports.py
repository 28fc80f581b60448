"""Which transport each transfer engine uses, decided at start-up and said in the log; a transport the
flags ask for that is missing fails start-up with a message naming what to change. Real Mooncake and NIXL
engines on this host where the decision meets the engine (this host has no RDMA device)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from common.config import ServerConfig
from transfer.backends.base import TransportUnavailable
from transfer.backends.mooncake import MooncakeBackend, check_transport, discovered_hcas
from transfer.backends.nixl import ucx_transports
from transfer.manager import kv_args_from_pool

NO_HCA = '{\n\t"cpu:0" : \n\t[\n\t\t[],\n\t\t[]\n\t]\n}\n'  # what Mooncake reports on this host
TWO_HCAS = '{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_0"], []]}'


def test_mooncake_topology_lists_its_rdma_devices():
    assert discovered_hcas(NO_HCA) == []
    assert discovered_hcas(TWO_HCAS) == ["mlx5_0", "mlx5_1"]


@pytest.mark.parametrize(
    "protocol, topology, env, described",
    [
        ("tcp", NO_HCA, {}, "tcp"),
        ("tcp", TWO_HCAS, {"MC_FORCE_TCP": "1"}, "tcp"),
        ("rdma", TWO_HCAS, {}, "rdma over mlx5_0,mlx5_1"),
        ("tcp", NO_HCA, {"MC_INTRANODE_NVLINK": "true"}, "nvlink (within one host, device memory only)"),
    ],
)
def test_mooncake_transport_described(protocol, topology, env, described):
    assert check_transport(protocol, discovered_hcas(topology), env) == described


@pytest.mark.parametrize(
    "topology, env, says",
    [(NO_HCA, {}, "found no RDMA device"), (TWO_HCAS, {"MC_FORCE_TCP": "1"}, "MC_FORCE_TCP is set")],
)
def test_mooncake_rdma_that_cannot_happen_is_refused(topology, env, says):
    with pytest.raises(TransportUnavailable) as e:
        check_transport("rdma", discovered_hcas(topology), env)
    assert says in str(e.value) and "--transfer-protocol" in str(e.value)


def test_a_real_mooncake_engine_asked_for_rdma_on_a_host_without_rdma_fails_at_start(monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with pytest.raises(TransportUnavailable, match="--transfer-protocol rdma: Mooncake found no RDMA device"):
        MooncakeBackend("127.0.0.1", "rdma")


def test_a_real_mooncake_engine_with_nvlink_refuses_the_host_aux_buffer(monkeypatch):
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "true")
    backend = MooncakeBackend("127.0.0.1", "tcp")
    aux = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(TransportUnavailable, match="unset MC_INTRANODE_NVLINK"):
        backend.register(aux.data_ptr(), aux.numel(), on_device=False)


def test_the_transfer_engine_is_named_at_start_up(caplog):
    from tests.unit.test_transfer_protocol import Side

    with caplog.at_level(logging.INFO, logger="transfer.manager"):
        side = Side("prefill", backend="mooncake")
    side.manager.close()
    assert "prefill KV transfer: Mooncake, transport tcp" in caplog.text


@pytest.mark.parametrize(
    "protocol, on_cuda, env, tls",
    [
        ("tcp", True, {}, "cuda_ipc,cuda_copy,tcp,sm,self"),
        ("rdma", True, {}, "cuda_ipc,cuda_copy,rc,sm,self"),
        ("tcp", True, {"UCX_TLS": "rc_x,cuda_ipc"}, None),  # the operator's choice stands
        ("tcp", False, {}, None),  # host memory: UCX's default
    ],
)
def test_ucx_transports_a_gpu_server_sets(protocol, on_cuda, env, tls):
    assert ucx_transports(protocol, on_cuda, env) == tls


def test_nixl_descriptors_name_the_pools_device_and_the_peers():
    """Local descriptors carry this pool's device, remote ones the peer's (its Register's), host memory 0."""
    from transfer.backends.nixl import NixlBackend

    backend, peer = NixlBackend(device_id=3), NixlBackend(device_id=5)
    backend.add_peer("peer", peer.address(), 5)
    seen = []

    def capture(descs, mem):
        seen.append((descs[:, 2].tolist(), mem))
        return len(seen)

    def stop(*args):
        raise RuntimeError("captured")

    backend.agent.get_xfer_descs, backend.agent.initialize_xfer = capture, stop
    for on_device in (True, False):
        with pytest.raises(RuntimeError, match="captured"):
            backend.write_batch("peer", [4096], [8192], [64], on_device=on_device)
    assert seen == [([3], "VRAM"), ([5], "VRAM"), ([0], "DRAM"), ([0], "DRAM")]
    assert "device 3" in backend.describe()
    backend.close()
    peer.close()


def test_the_kv_pools_cuda_device_reaches_the_transfer_args():
    info = SimpleNamespace(data_ptr=1 << 20, nbytes=4096, bytes_per_page=1024)
    pool = SimpleNamespace(device_index=2, buffer_infos=lambda: [info], num_pages=3, page_size=16, kv_heads=1)
    args = kv_args_from_pool(pool, ServerConfig(device="cuda", transfer_backend="nixl"))
    assert args.on_cuda and args.device_index == 2

"""The decode's bootstrap lookups stay off the request path (a real `tandem bootstrap` process): steady
traffic is answered from the cache at once while entries in use are refreshed in the background, and a
bootstrap that died is still noticed within the cache's lifetime."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from common.wire.api import Rendezvous
from decode_node.peers import CACHE_TTL_S, REFRESH_AFTER_S, PeerDirectory, PeerInfo
from tests.conftest import ServerProcess, free_port

LAYOUT = {
    "tp_size": 1,
    "num_layers": 2,
    "kv_heads": 1,
    "head_dim": 8,
    "dtype": "float32",
    "page_size": 4,
    "transfer_backend": "mooncake",
    "model_id": "0123456789abcdef",
    "attention": "mha",
    "kv_scales": "none",
}
INSTANCE = "prefill-0123456789ab"


@pytest.fixture
def bootstrap():
    port = free_port()
    p = ServerProcess(["bootstrap", "--port", str(port)], port, name="peer-bootstrap").wait_ready(60)
    entry = {
        "role": "Prefill",
        "instance_id": INSTANCE,
        "tp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": 5555,
        **LAYOUT,
    }
    assert httpx.put(p.url + "/route", json=entry, timeout=5).status_code == 200
    yield p
    p.stop()


def counted(peers: PeerDirectory) -> list[float]:
    """When each lookup reached the registry (the directory's own HTTP call, spied on)."""
    calls: list[float] = []
    real = peers._lookup
    peers._lookup = lambda url, instance_id: (calls.append(time.monotonic()), real(url, instance_id))[1]
    return calls


def test_lookups_refresh_in_the_background_and_a_dead_bootstrap_is_noticed(bootstrap):
    peers = PeerDirectory(LAYOUT, None)
    calls = counted(peers)
    rendezvous = Rendezvous("127.0.0.1", bootstrap.port, 7, INSTANCE)
    want = PeerInfo("tcp://127.0.0.1:5555", INSTANCE)
    assert peers.find(rendezvous).result(10) == want and len(calls) == 1
    start = time.monotonic()
    while time.monotonic() - start < 2 * CACHE_TTL_S:  # steady traffic, past two cache lifetimes
        found = peers.find(rendezvous)
        assert found.done() and found.result() == want, "a request waited for a lookup"
        time.sleep(0.05)
    refreshes = len(calls) - 1
    assert 2 * CACHE_TTL_S / REFRESH_AFTER_S - 2 <= refreshes <= 2 * CACHE_TTL_S / REFRESH_AFTER_S + 1, calls

    bootstrap.signal(signal.SIGKILL)
    time.sleep(CACHE_TTL_S + 0.1)  # no traffic meanwhile: the next request must ask, and learns why it cannot
    found = peers.find(rendezvous)
    with pytest.raises(RuntimeError, match=f"bootstrap server http://127.0.0.1:{bootstrap.port} unreachable"):
        found.result(10)

"""PD across several hosts on one machine (tests/integration/netns.py): router, bootstrap, prefill and
decode each in its own network namespace with its own address, over Mooncake (TCP) and NIXL (UCX over
TCP only: shared memory would cross the namespaces). Greedy output equals a monolithic server's, and
every server advertised its own address, not 0.0.0.0 or 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.integration.cluster import generate
from tests.integration.netns import ns_cluster, unavailable

pytestmark = [pytest.mark.skipif(bool(why := unavailable()), reason=str(why)), pytest.mark.timeout(900)]

ENGINE = ("--page-size", "16", "--chunked-prefill-size", "64")
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}  # eth0: the namespace's only link to the others
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village by the sea," * 6]


@pytest.fixture(scope="module")
def prompts(builtin_model_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(prompts, reference_servers) -> list[list[int]]:
    mono = reference_servers.get(*ENGINE)  # test_pd.py's
    return [generate(mono.url, ids, 12)["output_ids"] for ids in prompts]


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def cluster(request):
    with ns_cluster(
        f"pd-{request.param}", request.param, ENGINE, env=UCX_TCP if request.param == "nixl" else None
    ) as running:
        yield running


def test_pd_across_hosts_equals_monolithic(cluster, prompts, expected):
    c, net = cluster
    for ids, want in zip(prompts, expected):
        assert generate(c.url, ids, 12)["output_ids"] == want
    c.wait_idle()
    prefill, decode = net.hosts["prefill"], net.hosts["decode"]
    entry = httpx.get(c.bootstrap.url + "/route", params={"engine_rank": 0, "target_dp_group": 0}).json()
    assert entry["rank_ip"] == prefill.address, entry  # the control endpoint the decode dialled
    workers = httpx.get(c.url + "/workers", timeout=5).json()["workers"]
    assert {w["url"] for w in workers} == {f"http://{prefill.address}:8000", f"http://{decode.address}:8000"}

"""PD behind a real Envoy with llm-d's convention: `tandem epp --prefill P --decode SIDECAR` picks the pair, the
gateway sends the request to the decode pod's pair sidecar (`tandem sidecar`) with the prefill in
x-prefiller-host-port, and the sidecar runs the PD exchange with it. Greedy output equals the monolithic server's,
plain and streamed, and both halves ran (each server's own request counter); with the picker dead and the gateway
failing open, the request reaches the sidecar with no prefill named and the decode computes it alone, still equal."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, metric, start_server
from tests.integration.gateway import Envoy, epp_address, start_epp

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "64")  # test_pd.py's mooncake flags: its monolithic reference
pytestmark = pytest.mark.timeout(900)
PROMPTS = [list(range(100, 160)), list(range(400, 430)), list(range(900, 1000))]


@pytest.fixture(scope="module")
def mono(reference_servers):
    return reference_servers.get(*FLAGS)


@pytest.fixture(scope="module")
def pair(mono):
    boot = free_port()
    prefill = start_server(
        "--disaggregation-mode",
        "prefill",
        "--transfer-backend",
        "mooncake",
        "--bootstrap-port",
        str(boot),
        *FLAGS,
        name="gw-prefill",
    )
    decode = start_server("--disaggregation-mode", "decode", "--transfer-backend", "mooncake", *FLAGS, name="gw-decode")
    try:
        prefill.wait_ready(300), decode.wait_ready(300)
        port = free_port()
        args = ["sidecar", "--decode", decode.url, "--port", str(port), "--host", "127.0.0.1"]
        sidecar = ServerProcess(args, port, name="gw-sidecar").wait_ready(60)
        yield prefill, decode, sidecar, prefill.arg("--bootstrap-port")
        sidecar.stop()
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def epp(pair):
    prefill, _, sidecar, boot = pair
    p = start_epp("--prefill", prefill.url, boot, "--decode", sidecar.url, policy="round_robin")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def envoy(pair, epp, tmp_path_factory):
    sidecar = pair[2].url.removeprefix("http://")
    e = Envoy(epp_address(epp), [sidecar], [sidecar], tmp_path_factory.mktemp("envoy")).wait_ready(60)
    yield e
    e.stop()


def served(server) -> float:
    return metric(server.url, "tandem_requests_total", endpoint="/generate", status="200")


def generate(url: str, ids: list[int], **extra) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}, **extra}
    return httpx.post(url + "/generate", json=body, timeout=120)


def test_pd_through_envoy_and_the_sidecar_equals_monolithic(mono, pair, envoy):
    prefill, decode = pair[0], pair[1]
    want = [generate(mono.url, ids).json()["output_ids"] for ids in PROMPTS]
    before = served(prefill), served(decode)
    got = [generate(envoy.listener("fail_close"), ids) for ids in PROMPTS]
    assert [r.status_code for r in got] == [200] * len(PROMPTS), got[-1].text
    assert [r.json()["output_ids"] for r in got] == want
    assert (served(prefill) - before[0], served(decode) - before[1]) == (len(PROMPTS), len(PROMPTS))


def test_pd_stream_through_envoy_ends_with_the_exact_tokens(mono, envoy):
    want = generate(mono.url, PROMPTS[0]).json()["output_ids"]
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "stream": True}
    with httpx.stream("POST", envoy.listener("subset") + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert len(events) > 1 and events[-1]["output_ids"] == want and lines[-1] == "data: [DONE]"


def test_picker_dead_fail_open_the_decode_computes_alone(mono, pair, epp, envoy):
    prefill = pair[0]
    want = generate(mono.url, PROMPTS[1]).json()["output_ids"]
    epp.signal(signal.SIGKILL)
    try:
        before = served(prefill)
        r = generate(envoy.listener("fail_open"), PROMPTS[1])
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
        assert served(prefill) == before  # no prefill was named: the decode computed the prompt itself
        assert generate(envoy.listener("fail_close"), PROMPTS[1]).status_code == 500
    finally:
        epp.restart().wait_ready(60)

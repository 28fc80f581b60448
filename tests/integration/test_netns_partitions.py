"""Network partitions between hosts (tests/integration/netns.py), each at three moments of a request and
then healed: the prefill-decode link down, prefill->decode dropped one way only and the other way round,
and the router cut from the decode. Mooncake over TCP, short heartbeats.

For each: the request ends within BOUND_S of the cut, with an error naming the cause (a partition that
comes after the KV moved does not touch the request: it ends with every token exact); no page stays held
on any node once idle, and every pool's integrity holds; after the heal the cluster serves exact tokens
again within RECOVERY_S, the long prompt included (a late write into pages the decode reused
would change them)."""

from __future__ import annotations

import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import record_fault
from tests.integration.cluster import generate
from tests.integration.faults import Background, Outcome, chunks_sent, pages_held, wait_until
from tests.integration.netns import ns_cluster, unavailable
from tests.integration.test_parity_hf import LONG_TEXT

pytestmark = [pytest.mark.skipif(bool(why := unavailable()), reason=str(why)), pytest.mark.timeout(900)]

HEARTBEAT_S, MISSES = 0.5, 3
WINDOW_S = HEARTBEAT_S * MISSES  # a peer silent this long is dead
ENGINE = ("--page-size", "16", "--chunked-prefill-size", "32")
FAULTS = ("--heartbeat-interval-s", str(HEARTBEAT_S), "--heartbeat-misses", str(MISSES), "--transfer-timeout-s", "5")
ROUTER = ("--health-check-timeout-s", "1", "--health-failure-threshold", "2")
ROUTER_HEALTH_S = 1.0 + 0.5  # a check sent during the cut times out (1 s); the next comes an interval (0.5 s) later
RECOVERY_S = max(WINDOW_S, ROUTER_HEALTH_S) + 0.25  # + the client's retry and one round trip
BOUND_S = 8.0  # every request ends within this of the cut
HOLD_S = 2 * WINDOW_S  # the cut lasts at least this: both sides have given up on each other and freed pages
STREAM_TOKENS = 80
MOMENTS = ["before pairing", "mid-transfer", "mid-stream"]
PARTITIONS = {  # name -> the (from, to) directions dropped
    "prefill-decode link down": [("prefill", "decode"), ("decode", "prefill")],
    "prefill->decode dropped": [("prefill", "decode")],
    "decode->prefill dropped": [("decode", "prefill")],
    "router cut from decode": [("router", "decode"), ("decode", "router")],
}


@pytest.fixture(scope="module")
def prompts(builtin_model_dir) -> dict[str, list[int]]:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    return {
        "long": tok.encode(LONG_TEXT * 2),
        "story": tok.encode("Once upon a time, in a village by the sea,"),
        "a": tok.encode("The weather today is"),
        "fresh": tok.encode("Case"),  # + two numbers: a prefix of the long prompt that no test repeats
    }


@pytest.fixture(scope="module")
def expected(prompts, reference_servers) -> dict[str, list[int]]:
    mono = reference_servers.get(*ENGINE)  # test_faults.py's
    want = {k: generate(mono.url, prompts[k], 8)["output_ids"] for k in ("long", "a")}
    want["story"] = generate(mono.url, prompts["story"], STREAM_TOKENS, sampling={"ignore_eos": True})["output_ids"]
    return want


@pytest.fixture(scope="module")
def cluster():
    with ns_cluster("partitions", "mooncake", ENGINE + FAULTS, ROUTER) as running:
        yield running


@pytest.fixture(autouse=True)
def healed_after(cluster):
    yield
    cluster[1].heal()  # also when the test failed: the next one starts on a whole network


def body(ids: list[int], new: int, stream: bool = False) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }


def cut(net, partition: str) -> float:
    for src, dst in PARTITIONS[partition]:
        net.drop(net.hosts[src], net.hosts[dst])
    return time.monotonic()


def start_at(moment: str, c, net, partition: str, fresh: list[int], prompts) -> tuple[Background, float]:
    """A request, and the partition made at `moment` of it; returns both and when the cut was made.
    `fresh` is a long prompt no server has cached, so that its prefill takes many chunks."""
    if moment == "before pairing":
        t_cut = cut(net, partition)
        return Background(c.url, body(fresh, 8)), t_cut
    if moment == "mid-transfer":
        before = chunks_sent(c.prefills[0])
        req = Background(c.url, body(fresh, 8))
        wait_until(lambda: chunks_sent(c.prefills[0]) > before, 60, "the prefill to send KV chunks")
        assert req.outcome.ended_at is None
        return req, cut(net, partition)
    req = Background(c.url, body(prompts["story"], STREAM_TOKENS, stream=True))
    wait_until(lambda: len(req.outcome.events) >= 3, 60, "the first streamed tokens")
    return req, cut(net, partition)


def untouched(partition: str, moment: str) -> bool:
    """The KV had moved and the router still reaches the decode: the request must simply complete."""
    return moment == "mid-stream" and not partition.startswith("router")


def check_outcome(o: Outcome, partition: str, moment: str, want: list[int]) -> str:
    """What the client saw, after checking it."""
    if untouched(partition, moment):
        assert o.status == 200 and o.error is None and o.done_marker, o
        assert o.output_ids == want
        return f"HTTP 200, all {len(want)} tokens exact"
    message = o.error_message
    assert o.status != 200 or o.error, o
    assert any(cause in message for cause in ("heartbeat", "health", "prefill", "decode")), message
    if o.events:
        assert o.output_ids == want[: len(o.output_ids)]  # what did arrive was right
        return f"SSE error event: {message[:70]}"
    return f"HTTP {o.status}: {message[:70]}"


def serves_again(c, prompts, expected, since: float) -> float:
    """Seconds from `since` until the start of the first request through the router that gave exact tokens
    (its own service time is not recovery: this machine may be slow)."""
    refused = []
    while True:
        sent = time.monotonic()
        try:
            r = httpx.post(c.url + "/generate", json=body(prompts["a"], 8), timeout=30)
            if r.status_code == 200:
                assert r.json()["output_ids"] == expected["a"]
                return sent - since
            refused.append(f"{sent - since:.2f} s: HTTP {r.status_code} {r.text[:150]}")
        except httpx.HTTPError as e:
            refused.append(f"{sent - since:.2f} s: {e!r}")
        assert time.monotonic() - since < 30, "no exact answer 30 s after the heal:\n" + "\n".join(refused)
        time.sleep(0.05)


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("partition", list(PARTITIONS))
def test_partition_then_heal(cluster, prompts, expected, partition, moment):
    c, net = cluster
    want = expected["story"] if moment == "mid-stream" else []
    fresh = prompts["fresh"] + [100 + list(PARTITIONS).index(partition), 100 + MOMENTS.index(moment)] + prompts["long"]
    req, t_cut = start_at(moment, c, net, partition, fresh, prompts)
    o = req.wait(120 if untouched(partition, moment) else BOUND_S + 10)
    took = o.ended_at - t_cut
    saw = check_outcome(o, partition, moment, want)
    assert untouched(partition, moment) or took < BOUND_S, (took, saw)
    time.sleep(max(0.0, t_cut + HOLD_S - time.monotonic()))
    # some direction saw traffic (before pairing, the side that was never reached has nothing to answer)
    assert any(net.dropped(net.hosts[dst]) for _, dst in PARTITIONS[partition]), "the cut was never crossed"
    net.heal()
    recovery = serves_again(c, prompts, expected, time.monotonic())
    leaked = 0
    for node in c.nodes:
        wait_until(lambda: pages_held(node) == 0, 20, f"{node.name} to free its pages")
        leaked += pages_held(node)
        node.wait_idle()  # every pool's integrity, checked by the server
    assert generate(c.url, prompts["long"], 8)["output_ids"] == expected["long"]
    record_fault(
        f"{partition}, {moment}, healed", saw, None if untouched(partition, moment) else took, leaked, recovery
    )
    assert recovery <= RECOVERY_S, f"served again only {recovery:.2f} s after the heal"

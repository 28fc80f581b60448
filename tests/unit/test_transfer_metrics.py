"""The transfer layer's metrics (loopback backend, real ZMQ on 127.0.0.1), read from the Prometheus text
a server would expose: one room's latency on each side, and for every failure cause a scenario that
fails one room and increments that cause, and nothing else, on each side."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from common.edge.prometheus import render
from tests.unit.test_transfer_faults import Fatal
from tests.unit.test_transfer_protocol import AUX_BYTES, Side, block_writes_to, start_room, wait_for
from transfer.decode.receiver import KVReceiver
from transfer.metrics import CAUSES
from transfer.poll import DuplicateRoom, KVPoll
from transfer.prefill.sender import KVSender

AUX = bytes(AUX_BYTES)


def scrape(side: Side) -> dict[str, dict[str, float]]:
    """{series name: {the label that varies (or ""): value}} of the manager's metrics, as /metrics shows them."""
    registry = CollectorRegistry()
    registry.register(side.manager.metrics)
    role = side.manager.mode
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(render(registry, role).decode()):
        for s in family.samples:
            assert s.labels.pop("role") == role
            key = s.labels.get("cause") or s.labels.get("event") or s.labels.get("le") or ""
            out.setdefault(s.name, {})[key] = s.value
    return out


def failures(side: Side) -> dict[str, float]:
    """The causes counted so far (every cause is exported, the others at 0)."""
    counted = scrape(side)["tandem_kv_transfer_failures_total"]
    assert set(counted) == set(CAUSES)
    return {cause: n for cause, n in counted.items() if n}


@pytest.fixture
def sides():
    made: list[Side] = []

    def make(mode: str, **kwargs) -> Side:
        made.append(Side(mode, **kwargs))
        return made[-1]

    yield make
    for side in made:
        if not side.manager.stopped:
            side.manager.close()


def test_a_room_that_succeeds_is_counted_and_timed_once_on_each_side(sides):
    prefill, dec = sides("prefill"), sides("decode")
    entered, release = block_writes_to(prefill, dec.manager.instance_id)
    sender, receiver = start_room(prefill, dec, 1, [1, 2])
    sender.send([3, 4], is_last=True, aux=AUX)
    assert entered.wait(5)
    time.sleep(0.2)  # the write takes at least this long: the latency covers it
    release.set()
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    for side in (prefill, dec):
        m = scrape(side)
        assert m["tandem_kv_transfer_events_total"]["rooms_succeeded"] == 1 and failures(side) == {}
        assert m["tandem_kv_transfer_latency_seconds_count"][""] == 1
        assert 0.2 <= m["tandem_kv_transfer_latency_seconds_sum"][""] < 5
        assert (
            m["tandem_kv_transfer_latency_seconds_bucket"]["0.1"] == 0
            and m["tandem_kv_transfer_latency_seconds_bucket"]["5.0"] == 1
        )
    assert scrape(prefill)["tandem_kv_transfer_events_total"]["bytes_sent"] == 2 * sum(prefill.args.bytes_per_page)


# -- one scenario per cause: drive it, wait until both sides are done with the room -----------------


def queue_full(prefill: Side, dec: Side) -> None:
    prefill.manager.args.max_queued_chunks = 1
    entered, release = block_writes_to(prefill, dec.manager.instance_id)
    rooms = [start_room(prefill, dec, room, [room]) for room in (1, 2, 3)]
    rooms[0][0].send([1], is_last=True, aux=AUX)
    assert entered.wait(5)
    rooms[1][0].send([2], is_last=True, aux=AUX)
    rooms[2][0].send([3], is_last=True, aux=AUX)  # the bound is reached: this room fails
    release.set()
    wait_for(lambda: [r.poll() for _, r in rooms] == [KVPoll.Success, KVPoll.Success, KVPoll.Failed])


def write_raising(name: str, error: BaseException) -> Callable[[Side, Side], None]:
    """The scenario `name`: the backend's write raises `error` (a Fatal kills the transfer thread)."""

    def scenario(prefill: Side, dec: Side) -> None:
        def write_batch(*args, **kwargs):
            raise error

        prefill.manager.backend.write_batch = write_batch
        sender, receiver = start_room(prefill, dec, 1, [1])
        sender.send([1], is_last=True, aux=AUX)
        wait_for(lambda: receiver.poll() == KVPoll.Failed and receiver.writes_settled)

    scenario.__name__ = name
    return scenario


worker_died = write_raising("worker_died", Fatal("the engine binding crashed"))
transfer_error = write_raising("transfer_error", RuntimeError("connection reset by peer"))


def fenced(prefill: Side, dec: Side) -> None:
    sender, receiver = start_room(prefill, dec, 1, [1])
    prefill.manager.liveness.wall_clock = lambda: time.time() + 5  # as if this prefill slept 5 s
    sender.send([2], is_last=True, aux=AUX)
    wait_for(lambda: receiver.poll() == KVPoll.Failed and receiver.writes_settled)
    assert prefill.manager.counters["writes_fenced"] == 1


def overrun(prefill: Side, dec: Side) -> None:
    sender, receiver = start_room(prefill, dec, 1, [1])
    sender.send([1, 2], is_last=True, aux=AUX)  # two pages into the one the decode reserved
    wait_for(lambda: receiver.poll() == KVPoll.Failed and receiver.writes_settled)


def prefill_aborts(prefill: Side, dec: Side) -> None:
    sender, receiver = start_room(prefill, dec, 1, [1])
    sender.abort("client went away")
    wait_for(lambda: receiver.poll() == KVPoll.Failed and receiver.writes_settled)


def decode_aborts(prefill: Side, dec: Side) -> None:
    sender, receiver = start_room(prefill, dec, 1, [1])
    receiver.abort("client went away")
    wait_for(lambda: sender.poll() == KVPoll.Failed and receiver.writes_settled)


def kv_wait_timeout(prefill: Side, dec: Side) -> None:
    receiver = KVReceiver(dec.manager, 1, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)  # no prefill request ever computes this room
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    receiver.abort("done")  # what the decode role does next: not a second failure
    wait_for(lambda: receiver.writes_settled)


def decode_sees_a_dead_prefill(prefill: Side, dec: Side) -> None:
    _, receiver = start_room(prefill, dec, 1, [1])
    prefill.manager.close()  # no more pongs
    wait_for(lambda: receiver.poll() == KVPoll.Failed)


def prefill_sees_a_dead_decode(prefill: Side, dec: Side) -> None:
    sender, _ = start_room(prefill, dec, 1, [1])
    dec.manager.close()  # no more pings
    wait_for(lambda: sender.poll() == KVPoll.Failed)


def refused_layout(prefill: Side, dec: Side) -> None:
    dec.manager.args.bytes_per_page = [b * 2 for b in dec.manager.args.bytes_per_page]
    receiver = KVReceiver(dec.manager, 1, prefill.manager.endpoint, prefill.manager.instance_id)
    receiver.init([1], aux_slot=0)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)


def duplicate_rooms(prefill: Side, dec: Side) -> None:
    sender, receiver = start_room(prefill, dec, 1, [1])
    with pytest.raises(DuplicateRoom):
        KVSender(prefill.manager, 1)
    with pytest.raises(DuplicateRoom):
        KVReceiver(dec.manager, 1, prefill.manager.endpoint, prefill.manager.instance_id)
    sender.send([1], is_last=True, aux=AUX)  # the room that holds the id goes on
    wait_for(lambda: receiver.poll() == KVPoll.Success)


def room_requested_twice(prefill: Side, dec: Side) -> None:
    sender, receiver = start_room(prefill, dec, 1, [1])
    other = Side("decode")  # a second decode asks for the same room: only its own room fails
    try:
        late = KVReceiver(other.manager, 1, prefill.manager.endpoint, prefill.manager.instance_id)
        late.init([2], aux_slot=0)
        wait_for(lambda: late.poll() == KVPoll.Failed)
        assert failures(other) == {"peer_failed": 1} and "requested twice" in late.failure_reason
    finally:
        other.manager.close()
    sender.send([1], is_last=True, aux=AUX)
    wait_for(lambda: receiver.poll() == KVPoll.Success)


Scenario = Callable[[Side, Side], None]
FAST = {"heartbeat_s": 0.2}
CASES: list[tuple[Scenario, dict, dict, dict[str, int], dict[str, int]]] = [
    # scenario, prefill Side kwargs, decode Side kwargs, prefill causes, decode causes
    (queue_full, {}, {}, {"queue_full": 1}, {"peer_failed": 1}),
    (worker_died, {}, {}, {"worker_died": 1}, {"peer_failed": 1}),
    (transfer_error, {}, {}, {"transfer_error": 1}, {"peer_failed": 1}),
    (fenced, {"heartbeat_s": 0.3}, {"heartbeat_s": 0.3}, {"fenced": 1}, {"peer_failed": 1}),
    (overrun, {}, {}, {"overrun": 1}, {"peer_failed": 1}),
    (prefill_aborts, {}, {}, {"aborted": 1}, {"peer_failed": 1}),
    (decode_aborts, {}, {}, {"peer_aborted": 1}, {"aborted": 1}),
    (kv_wait_timeout, {}, {"timeout": 0.5}, {}, {"timeout": 1}),
    (decode_sees_a_dead_prefill, {}, FAST, {}, {"peer_dead": 1}),
    (prefill_sees_a_dead_decode, FAST, FAST, {"peer_dead": 1}, {}),
    (refused_layout, {}, {}, {"refused_layout": 1}, {"peer_failed": 1}),
    (duplicate_rooms, {}, {}, {"duplicate": 1}, {"duplicate": 1}),
    (room_requested_twice, {}, {}, {"duplicate": 1}, {}),
]


@pytest.mark.parametrize(
    ("scenario", "prefill_kw", "decode_kw", "on_prefill", "on_decode"), CASES, ids=[c[0].__name__ for c in CASES]
)
def test_each_failure_is_counted_once_under_its_cause(sides, scenario, prefill_kw, decode_kw, on_prefill, on_decode):
    prefill, dec = sides("prefill", **prefill_kw), sides("decode", **decode_kw)
    scenario(prefill, dec)
    time.sleep(0.2)  # a second count, if there were one, would come from a status or abort still on its way
    assert failures(prefill) == on_prefill
    assert failures(dec) == on_decode
    events = {side: scrape(side)["tandem_kv_transfer_events_total"] for side in (prefill, dec)}
    assert events[prefill]["rooms_failed"] == sum(
        n for c, n in on_prefill.items() if c not in ("duplicate", "refused_layout")
    )
    assert events[dec]["rooms_failed"] == sum(n for c, n in on_decode.items() if c != "duplicate")


def test_an_unknown_cause_is_a_bug_that_names_the_list():
    prefill = Side("prefill")
    try:
        with pytest.raises(ValueError, match="add it to transfer.metrics.CAUSES"):
            prefill.manager.metrics.failed("gremlins")
    finally:
        prefill.manager.close()

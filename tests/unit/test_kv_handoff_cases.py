"""Targeted scenarios of the KV handoff on the simulated PD pair of the model-based test
(test_kv_handoff_model.py): one interleaving each, chosen by hand, with exact assertions; each ends with
the model's teardown (every half ended within its bound, every pool back to idle)."""

from __future__ import annotations

import pytest

from common.core.request import ReqStatus
from common.wire.api import Rendezvous
from tests.unit.kv_handoff_sim import SECRET
from tests.unit.test_kv_handoff_model import KVHandoff, Pair, monolithic_answer
from transfer.messages import FirstToken, open_frame
from transfer.prefill.sender import KVSender


def test_a_prefill_stops_computing_a_prompt_whose_room_failed():
    """A 30-token prompt computed 8 tokens a step: once its room fails (here the decode aborted it), the
    prefill request ends at its next step instead of computing the rest of the prompt for nobody."""
    m = KVHandoff()
    m.new_request(prompt_len=30, max_new=2, stream_first=False)
    pair = m.pairs[0]
    for _ in range(20):
        if 0 < pair.prefill.kv_len < 30:
            break
        m._one_round()
    computed = pair.prefill.kv_len
    assert 0 < computed < 30 and not pair.prefill.finished
    m.decode.sched.abort(pair.decode, "client went away")
    m.decode.sched.step()  # the decode ends its half and tells the prefill
    while m.net.deliverable():
        m.net.deliver(0)
    m.prefill.sched.step()
    assert pair.prefill.finished  # one step after the failure, with 8 of 30 tokens computed (not 16, unfinished)
    assert "decode aborted: client went away" in pair.prefill.finish.message
    m.teardown()  # every half ended, every pool back to idle


def test_a_prefill_computes_its_prompt_while_the_decode_pairs():
    """The prefill computes the whole prompt before the decode's room request reaches it (no frame is
    delivered), holding its pages but queueing none; once the request is in, the pages and the aux
    record go out and the decode's tokens are exact."""
    m = KVHandoff()
    m.new_request(prompt_len=30, max_new=2, stream_first=False)
    pair, role = m.pairs[0], m.prefill.sched.role
    for _ in range(6):  # 8 tokens a step
        m.prefill.sched.step()
    assert pair.prefill.kv_len == 30 and pair.prefill in role.inflight and not pair.prefill.finished
    assert role.queue_depths() == {"awaiting_decode": 1, "inflight": 1, "deferred": 0}
    assert role.outbound[pair.prefill].sent_tokens == 0 and not any(w.chunks for w in m.prefill.manager.workers.alive())
    m.teardown()  # the decode pairs, the KV moves, every pool back to idle
    assert pair.decode.finish.type == "length" and pair.decode.output_ids == [31, 32]


@pytest.mark.parametrize("max_new", [3, 1])
def test_the_decode_streams_the_first_token_before_the_kv_lands(max_new):
    """The prefill sends its aux record ahead of the KV: with no transfer run yet, the decode has already
    committed the first token (the client has it) but not joined the batch; once the KV lands the
    request goes on with exact tokens. A first token that ends the request (max_new 1) ends it only
    then, and the prefill's half ends normally (no abort of a room still being written)."""
    m = KVHandoff()
    m.new_request(prompt_len=10, max_new=max_new, stream_first=False)
    pair = m.pairs[0]
    for _ in range(10):  # frames delivered, both schedulers step; the transfer worker never runs
        while m.net.deliverable():
            m.net.deliver(0)
        m.decode.sched.step()
        m.prefill.sched.step()
        if pair.decode.output_ids:
            break
    assert pair.decode.output_ids == [11] and not pair.decode.finished
    assert pair.decode.status == ReqStatus.TRANSFERRING and pair.decode not in m.decode.sched.decode.running
    assert not m.decode.manager.rooms[pair.decode.rendezvous.room_id].status_received
    m.teardown()
    assert pair.decode.finish.type == "length" and pair.decode.output_ids == list(range(11, 11 + max_new))
    assert pair.prefill.finish.type == "length"


def test_requests_paired_in_the_opposite_order_do_not_wait_on_each_other():
    """The decode reserves Y1..Y5 first (its whole pool) and X1..X5 wait for its memory; the prefill gets
    X1..X5 first. Computing every X ahead of its pairing would fill the prefill's pool with KV that cannot
    be sent while the Ys, which the decode waits for, find no memory: both sides stuck until the pairing
    timeout failed them. Computing ahead stops at its bound, so every request ends with exact tokens, long
    before that timeout."""
    m = KVHandoff()
    rooms = {name: next(m.rooms) for name in [f"X{i}" for i in range(5)] + [f"Y{i}" for i in range(5)]}
    halves = {}
    for name, room in rooms.items():
        prompt = [room * 40 + i for i in range(30)]  # 30 tokens + 2 to generate: 8 of the 40 pages each side
        rendezvous = Rendezvous("sim", 1, room, m.prefill.manager.instance_id)
        halves[name] = (m._req(prompt, 2, rendezvous), m._req(prompt, 2, rendezvous))
    for name in sorted(rooms):  # X before Y
        m.prefill.sched.submit(halves[name][0])
    for name in sorted(rooms, reverse=True):  # Y before X
        m.decode.sched.submit(halves[name][1])
    for _ in range(40):  # 20 s of simulated time, under the 30 s pairing timeout
        m._one_round()
    for name, (prefill, decode) in halves.items():
        assert prefill.finished and prefill.finish.type == "length", f"{name}'s prefill: {prefill.finish}"
        assert decode.finished and decode.output_ids == [prefill.prompt_ids[-1] + 1, prefill.prompt_ids[-1] + 2], name
    assert m.prefill.sched.role.queue_depths() == {"awaiting_decode": 0, "inflight": 0, "deferred": 0}
    m.teardown()


def test_a_room_that_fails_during_its_last_forward_announces_no_first_token():
    """The room fails (here: the prefill gives up on it) while its last chunk is computed: the decode must
    not stream a first token for KV that will never come, so no FirstToken frame goes out."""
    m = KVHandoff()
    m.new_request(prompt_len=30, max_new=3, stream_first=False)  # chunks of 8, 8, 8 and 6 tokens
    pair = m.pairs[0]
    m.prefill.sched.step()  # the first chunk
    out = m.prefill.sched.role.outbound[pair.prefill]
    for _ in range(3):  # the decode reserves and asks for the room
        m.decode.sched.step()
        while m.net.deliverable():
            m.net.deliver(0)
    m.prefill.sched.step()  # pairs, the second chunk
    assert out.paired and pair.prefill.kv_len == 16
    real_run = m.prefill.runner.run

    def run_and_fail(plan):
        if pair.prefill.kv_len == 30:  # the last chunk (its slots are already reserved)
            out.sender.abort("the decode went away", "peer_dead")
        return real_run(plan)

    m.prefill.runner.run = run_and_fail
    for _ in range(4):
        m.prefill.sched.step()
    frames = [open_frame(raw, SECRET)[0] for _, raw in m.net.in_flight + m.net.delivered]
    assert not any(isinstance(f, FirstToken) for f in frames)
    assert pair.prefill.finish.type == "abort" and "the decode went away" in pair.prefill.finish.message
    m.teardown()


@pytest.mark.parametrize("forget_the_event", [False, True])
def test_the_transfer_reads_a_chunk_only_after_waiting_for_the_forward_that_wrote_it(forget_the_event, monkeypatch):
    """A 30-token prompt goes out in 4 chunks, each read by the transfer after it waited on the KV event
    recorded after the forward that wrote the chunk's pages (the simulated stream checks every page read).
    A sender that forgets the event is caught: its writes read pages no wait covered."""
    if forget_the_event:
        real_send = KVSender.send
        monkeypatch.setattr(
            KVSender, "send", lambda self, pages, is_last, aux, ready=None: real_send(self, pages, is_last, aux)
        )
    m = KVHandoff()
    m.new_request(prompt_len=30, max_new=2, stream_first=False)
    for _ in range(40):
        m._one_round()
    pair = m.pairs[0]
    assert pair.decode.finish.type == "length" and pair.decode.output_ids == [31, 32]
    assert m.prefill.manager.counters["chunks_sent"] >= 2
    if forget_the_event:
        assert m.bad_writes and "before its forward's KV event" in m.bad_writes[0]
    else:
        assert m.bad_writes == []


def test_a_starved_decode_waits_for_rooms_whose_kv_is_arriving_then_retracts_instead_of_503():
    """A decodes a long answer while B and C reserve most of the pool and their KV is still on its way
    (written, but the prefill's frames to the decode held back). Once A's next page does not fit it waits instead of
    failing with 503 "KV cache exhausted": B and C join the batch when their KV lands, the newest of
    least progress is retracted (its KV cached), and every request ends with exact tokens."""
    m = KVHandoff()
    m.new_request(prompt_len=8, max_new=56, stream_first=False)
    a = m.pairs[0].decode
    for _ in range(20):
        m._one_round()
        if a in m.decode.sched.decode.running:
            break
    for n in (1, 2):
        prompt = [100 * n + i for i in range(50)]  # 50 + 2 tokens: 13 of the 40 pages each
        rendezvous = Rendezvous("sim", 1, next(m.rooms), m.prefill.manager.instance_id)
        halves = [m._req(prompt, 2, rendezvous) for _ in range(2)]
        m.prefill.sched.submit(halves[0])
        m.decode.sched.submit(halves[1])
        m.pairs.append(Pair(*halves, m.prefill, m.decode, {}))
    for _ in range(80):  # frames to the decode held, no time passes: B and C stay transferring, A grows
        while to_prefill := [i for i in m.net.deliverable() if m.net.in_flight[i][0] == m.prefill.manager.endpoint]:
            m.net.deliver(to_prefill[0])
        m.prefill.run_transfers()
        m.prefill.sched.step()
        m.decode.sched.step()
        if m.decode.sched.starved_since is not None:
            break
    role = m.decode.sched.role
    assert m.decode.sched.starved_since is not None and not a.finished, a.finish
    assert role.queue_depths()["transferring"] == 2 and role.memory_returning()
    m.teardown()
    assert [p.decode.finish.type for p in m.pairs] == ["length"] * 3
    m.successful_requests_have_the_monolithic_tokens()
    assert m.decode.sched.decode.num_retractions >= 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_room_whose_kv_fails_ends_its_request_or_is_computed_by_the_decode(policy):
    """The decode wants KV checksums and the prefill sends none, so the room fails at its status, after the
    first token went ahead of the KV. --kv-load-failure-policy fail: the request ends with a 502 naming the
    cause (the router moves it). recompute: a husk keeps the room's pages until no write can land and the
    request is computed on the decode, its tokens exact; every pool back to idle either way."""
    m = KVHandoff()
    role = m.decode.sched.role
    role.config = role.config.model_copy(update={"kv_load_failure_policy": policy})
    m.decode.manager.args.kv_checksum = True
    m.new_request(prompt_len=30, max_new=4, stream_first=False)
    m.teardown()
    req = m.pairs[0].decode
    if policy == "fail":
        assert req.finish.status == 502 and "--disaggregation-enable-kv-checksum" in req.finish.message
        assert m.decode.manager.counters["rooms_recomputed"] == 0
    else:
        assert req.finish.type == "length" and req.output_ids == monolithic_answer(req.prompt_ids, 4)
        assert m.decode.manager.counters["rooms_recomputed"] == 1
    assert m.decode.manager.metrics.failures.labels("checksum")._value.get() == 1

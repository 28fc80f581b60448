"""The scheduler under faults it must contain: clients that repeat identifiers, a forward that fails
half way through a prompt, an error while handling one request, a step that never returns, a thread
that dies. Real pools, the fake runner of test_scheduler."""

from __future__ import annotations

import threading

from common.core.request import Req
from common.engine.decode_tensors import DecodeTensors
from common.engine.scheduler_thread import SchedulerThread
from common.wire.sampling_params import SamplingParams
from tests.unit.test_scheduler import expected_output, make, req, run_until_idle


def test_requests_sharing_a_rid_and_a_prompt_each_get_their_own_output():
    s, _ = make()
    twins = [req("same-rid", [5, 6, 7], max_new=3 + i) for i in range(6)]
    for r in twins:
        s.add_request(r)
    run_until_idle(s)
    for i, r in enumerate(twins):
        assert r.output_ids == expected_output([5, 6, 7], 3 + i) and r.finish.type == "length"
    assert s.memory.check_integrity().owned == 0


def test_a_forward_that_fails_mid_prompt_leaves_only_computed_kv_in_the_cache():
    s, runner = make(chunked_prefill_size=8)
    prompt = list(range(1, 30))  # 29 tokens: chunks of 8, 8, 8, 5
    real_run, calls = runner.run, []

    def run(plan):
        calls.append(plan)
        if len(calls) == 2:  # the second chunk: its KV was never written
            raise RuntimeError("CUDA out of memory")
        return real_run(plan)

    runner.run = run
    first = req("first", prompt, max_new=2)
    s.add_request(first)
    run_until_idle(s)
    assert first.finish.status == 500 and "CUDA out of memory" in first.finish.message
    assert len(s.memory.prefix_cache.match_prefix(prompt).slots) == 8  # the first chunk, not the failed one
    again = req("again", prompt, max_new=2)
    s.add_request(again)
    run_until_idle(s)
    assert again.prefix_hit_len == 8 and again.output_ids == expected_output(prompt, 2)
    assert s.memory.check_integrity().owned == 0


def test_an_error_while_handling_one_request_fails_only_that_request():
    s, _ = make()
    commit = s.output.commit_token

    def commit_token(r, *args):
        if r.rid == "bad":
            raise KeyError("a bug that only this request triggers")
        return commit(r, *args)

    s.output.commit_token = commit_token
    good = [req(f"good{i}", [10 * i + 1, 10 * i + 2], max_new=4) for i in range(3)]
    bad = req("bad", [3, 4], max_new=4)
    for r in [good[0], bad, *good[1:]]:
        s.add_request(r)
    run_until_idle(s)
    assert bad.finish.status == 500 and "a bug that only this request triggers" in bad.finish.message
    for r in good:
        assert r.output_ids == expected_output(r.prompt_ids, 4) and r.finish.type == "length"
    assert s.memory.check_integrity().owned == 0


def test_max_new_tokens_zero_computes_the_prompt_and_returns_no_token():
    s, runner = make()
    events: list = []
    r = req("score", [1, 2, 3, 4, 5], max_new=0, events=events)
    s.add_request(r)
    run_until_idle(s)
    assert r.output_ids == [] and r.finish.type == "length"
    assert [e.token_ids for e in events] == [[]] and len(runner.plans) == 1
    assert s.memory.check_integrity().owned == 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_names_a_step_that_runs_too_long():
    s, _ = make()
    clock = Clock()
    thread = SchedulerThread(s, watchdog_timeout_s=5.0, clock=clock)
    assert thread.health_problem() is None
    thread.step_started = clock.now
    clock.now += 4.0
    assert thread.health_problem() is None
    clock.now += 2.0
    problem = thread.health_problem()
    assert problem is not None and "running for 6 s" in problem and "--watchdog-timeout-s 5" in problem


def test_watchdog_reports_a_dead_scheduler_thread():
    s, _ = make()

    class Fatal(BaseException):
        pass

    def step():
        raise Fatal("the interpreter is going down")

    s.step = step
    thread = SchedulerThread(s, watchdog_timeout_s=60.0)
    thread.start()
    thread._thread.join(5)
    assert (
        "the scheduler thread died" in thread.health_problem()
        and "the interpreter is going down" in thread.health_problem()
    )


def test_a_step_that_raises_fails_the_tracked_requests_and_the_loop_goes_on():
    s, _ = make()
    events: list = []
    victim = req("victim", [1, 2], max_new=50, events=events)
    s.add_request(victim)
    real_step, broke = s.step, threading.Event()

    def step():
        if not broke.is_set():
            broke.set()
            raise RuntimeError("a bug outside any one request")
        return real_step()

    s.step = step
    thread = SchedulerThread(s, watchdog_timeout_s=60.0)
    thread.start()
    try:
        later = Req("later", [7, 8], SamplingParams(max_new_tokens=2, temperature=0))
        done = threading.Event()
        later.sink = lambda ev: done.set() if ev.finish else None
        s.submit(later)
        thread.wake()
        assert done.wait(5)
    finally:
        thread.stop()
    assert victim.finish.status == 500 and "a bug outside any one request" in victim.finish.message
    assert later.output_ids == [9, 10] and thread.health_problem() is None


def test_a_decode_step_whose_metadata_cannot_reach_the_device_fails_its_requests_and_leaks_nothing(monkeypatch):
    """The one copy of a step's metadata fails (a device error) after its pages were allocated: the
    batch's requests end with a 500 naming it and every page is back (some requests had opened a page)."""
    s, _ = make(page_size=4)
    reqs = [req(f"r{i}", list(range(1, 4 + i)), max_new=8) for i in range(4)]  # 3..6 tokens: some fill a page
    for r in reqs:
        s.add_request(r)
    while len(s.decode.running) < 4:
        s.step()
    monkeypatch.setattr(DecodeTensors, "upload", lambda self, *a: (_ for _ in ()).throw(RuntimeError("CUDA error")))
    s.step()
    assert all(r.finish.status == 500 and "CUDA error" in r.finish.message for r in reqs)
    counts = s.memory.check_integrity()
    assert counts.owned == 0 and counts.free + counts.evictable == counts.total

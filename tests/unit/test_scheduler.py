"""The scheduler with real pools and a fake model runner: batching, chunking, prefix reuse,
retraction and aborts, with pool integrity checked after every step."""

from __future__ import annotations

import pytest

from common.config import ServerConfig
from common.core.forward_batch import ForwardMode
from common.core.request import Req
from common.engine.model_runner import BatchPlan, BatchResult
from common.engine.output import OutputProcessor
from common.engine.role import Role
from common.engine.scheduler import Scheduler
from common.memory.allocator import PagedAllocator
from common.memory.manager import MemoryManager
from common.memory.prefix_cache import NoPrefixCache
from common.memory.radix_cache import RadixCache
from common.memory.req_to_token_pool import ReqToTokenPool
from common.wire.sampling_params import SamplingParams

VOCAB = 1000


class FakeTokenizer:
    eos_token_id = 999

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class FakeRunner:
    """Next token = (last token of the sequence so far + 1) % VOCAB; records every plan."""

    def __init__(self):
        self.plans: list[BatchPlan] = []

    def run(self, plan: BatchPlan) -> BatchResult:
        self.plans.append(plan)
        n = len(plan.reqs)
        ids = [(r.fill_ids[r.kv_len - 1] + 1) % VOCAB if s else None for r, s in zip(plan.reqs, plan.sample)]
        return BatchResult(ids, [None] * n, [None] * n, [None] * n)


def make(pages: int = 64, page_size: int = 4, radix: bool = True, **cfg) -> tuple[Scheduler, FakeRunner]:
    config = ServerConfig(page_size=page_size, max_total_tokens=pages * page_size, **cfg)
    allocator = PagedAllocator(pages, page_size)
    cache = RadixCache(allocator, page_size) if radix else NoPrefixCache(allocator, page_size)
    kv = MemoryManager(ReqToTokenPool(config.max_running_requests + 2, 512, "cpu"), allocator, cache, page_size)
    runner = FakeRunner()
    out = OutputProcessor(FakeTokenizer(), {999}, context_len=500)
    return Scheduler(config, runner, kv, out), runner


def req(rid: str, prompt: list[int], max_new: int = 4, events: list | None = None) -> Req:
    r = Req(rid, prompt, SamplingParams(max_new_tokens=max_new, temperature=0))
    if events is not None:
        r.sink = events.append
    return r


def run_until_idle(s: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if not s.step():
            break
        s.memory.check_integrity()
    assert not s.has_work()


def expected_output(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + i) % VOCAB for i in range(1, n + 1)]


def test_batch_of_requests_completes_with_exact_tokens_and_no_leak():
    s, runner = make()
    reqs = [req(f"r{i}", list(range(10 * i, 10 * i + 7)), max_new=5) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    run_until_idle(s)
    for r in reqs:
        assert r.output_ids == expected_output(r.prompt_ids, 5)
        assert r.finish.type == "length"
    assert runner.plans[0].mode == ForwardMode.EXTEND and len(runner.plans[0].reqs) == 4
    assert all(p.mode == ForwardMode.DECODE and len(p.reqs) == 4 for p in runner.plans[1:])
    counts = s.memory.check_integrity()
    assert counts.owned == counts.locked == 0 and counts.free + counts.evictable == 64


def test_chunked_prefill_splits_long_prompt_into_page_aligned_chunks():
    s, runner = make(chunked_prefill_size=8)
    r = req("long", list(range(1, 22)), max_new=2)
    s.add_request(r)
    run_until_idle(s)
    assert [p.extend_lens[0] for p in runner.plans if p.mode == ForwardMode.EXTEND] == [8, 8, 5]
    assert [p.sample[0] for p in runner.plans if p.mode == ForwardMode.EXTEND] == [False, False, True]
    assert r.output_ids == expected_output(r.prompt_ids, 2)


def test_second_request_reuses_the_cached_prefix():
    s, runner = make()
    prompt = list(range(100, 117))  # 17 tokens: 4 full pages can be shared
    first = req("a", prompt, max_new=1)
    s.add_request(first)
    run_until_idle(s)
    second = req("b", prompt + [5, 6], max_new=1)
    s.add_request(second)
    run_until_idle(s)
    assert second.prefix_hit_len == 16
    assert runner.plans[-1].extend_lens == [3]


def test_retraction_under_memory_pressure_requeues_and_still_finishes_exactly():
    s, _ = make(pages=12, page_size=4, max_running_requests=4)
    reqs = [req(f"r{i}", list(range(50 * i + 1, 50 * i + 9)), max_new=12) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    run_until_idle(s)
    assert s.decode.num_retractions > 0
    for r in reqs:
        assert r.output_ids == expected_output(r.prompt_ids, 12)


@pytest.mark.parametrize("stage", ["waiting", "chunked", "running"])
def test_abort_at_any_stage_frees_everything(stage):
    s, _ = make(chunked_prefill_size=8)
    events: list = []
    r = req("x", list(range(1, 30)), max_new=50, events=events)
    s.add_request(r)
    if stage == "chunked":
        s.step()
        assert s.prefill.chunked is r
    elif stage == "running":
        while r not in s.decode.running:
            s.step()
    s.abort_now(r, "client went away", 499)
    assert r.finish.type == "abort" and events[-1].finish.message == "client went away"
    run_until_idle(s)
    counts = s.memory.check_integrity()
    assert counts.owned == counts.locked == 0


def test_a_request_that_cannot_be_queued_still_gets_its_answer(monkeypatch):
    s, _ = make()
    events: list = []
    r = req("bad", [1, 2, 3], max_new=4, events=events)
    monkeypatch.setattr(s.output, "prepare", lambda req: 1 / 0)  # any bug while queueing
    s.submit(r)
    s.step()
    assert r.finish.type == "abort" and r.finish.status == 500 and events[-1].finish is r.finish
    assert s.memory.check_integrity().owned == 0


@pytest.mark.parametrize("failing_step", [0, 3])  # the prefill forward, a decode forward
def test_a_failing_forward_ends_its_batch_with_an_error_and_the_server_goes_on(failing_step):
    s, runner = make()
    events: list = []
    a, b = req("a", [1, 2, 3], max_new=6, events=events), req("b", [7, 8], max_new=6, events=events)
    s.add_request(a)
    s.add_request(b)
    real_run, calls = runner.run, []

    def run(plan):
        calls.append(plan)
        if len(calls) - 1 == failing_step:
            raise RuntimeError("invalid multinomial distribution")
        return real_run(plan)

    runner.run = run
    run_until_idle(s)
    for r in (a, b):
        assert r.finish.type == "abort" and r.finish.status == 500 and "invalid multinomial" in r.finish.message
    assert s.memory.check_integrity().owned == 0 and not s.decode.running and s.prefill.chunked is None
    later = req("c", [4, 5], max_new=2)
    s.add_request(later)
    run_until_idle(s)
    assert later.output_ids == [6, 7]


def test_stop_token_and_eos_finish_with_the_matched_token():
    s, _ = make()
    r = Req("s", [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[6]))
    s.add_request(r)
    run_until_idle(s)
    assert r.output_ids == [4, 5, 6] and r.finish.type == "stop" and r.finish.matched == 6
    e = Req("e", [996], SamplingParams(max_new_tokens=10, temperature=0))
    s.add_request(e)
    run_until_idle(s)
    assert e.output_ids == [997, 998, 999] and e.finish.matched == 999


def test_without_radix_cache_every_page_returns_to_the_free_list():
    s, _ = make(radix=False, disable_radix_cache=True)
    for i in range(3):
        s.add_request(req(f"r{i}", list(range(1, 20)), max_new=3))
    run_until_idle(s)
    counts = s.memory.check_integrity()
    assert counts.free == 64


class PagesElsewhere(Role):
    """Holds `pages` of the pool outside any request, as a decode's quarantined rooms do, and gives them
    back at its `give_back_at`-th poll; says they are coming back only when `returning`."""

    def __init__(self, s: Scheduler, pages: int, give_back_at: int, returning: bool):
        self.s, self.held, self.give_back_at, self.returning, self.polls = (
            s,
            s.memory.allocator.alloc(pages),
            give_back_at,
            returning,
            0,
        )

    def poll(self) -> None:
        self.polls += 1
        if self.held and self.polls >= self.give_back_at:
            self.s.memory.allocator.free(self.held)
            self.held = []

    def memory_returning(self) -> bool:
        return self.returning and bool(self.held)


@pytest.mark.parametrize("returning", [True, False])
def test_a_request_the_pool_cannot_fit_waits_for_pages_coming_back_else_fails_503(returning):
    """One running request needs a third page while two of the four are held elsewhere: it waits when
    they are on their way back (a decode's quarantined rooms) and then finishes exactly; otherwise it
    fails with 503 at once, as nothing would free them."""
    s, _ = make(pages=4, page_size=4)
    s.role = PagesElsewhere(s, 2, give_back_at=30, returning=returning)
    r = req("r", list(range(1, 8)), max_new=8)
    s.add_request(r)
    for _ in range(60):
        s.step()
        if r.finished:
            break
    if returning:
        assert r.finish.type == "length" and r.output_ids == expected_output(r.prompt_ids, 8)
        assert s.role.polls >= 30  # it waited for them
    else:
        assert r.finish.type == "abort" and r.finish.status == 503 and "KV cache exhausted" in r.finish.message
        assert s.role.polls < 30
        s.memory.allocator.free(s.role.held)
    s.memory.check_integrity()


def test_waiting_for_pages_coming_back_ends_at_the_transfer_timeout():
    """Pages said to be on their way back that never come: the running request ends with 503 once
    --transfer-timeout-s has passed, not never."""
    s, _ = make(pages=4, page_size=4, transfer_timeout_s=1)
    now = [0.0]
    s.clock = lambda: now[0]
    s.role = PagesElsewhere(s, 2, give_back_at=10**9, returning=True)
    r = req("r", list(range(1, 8)), max_new=8)
    s.add_request(r)
    for _ in range(40):
        s.step()
        now[0] += 0.1
        if r.finished:
            break
    assert r.finish.status == 503 and "KV cache exhausted" in r.finish.message
    assert 1.0 < now[0] <= 1.5 and s.starved_since is None
    s.memory.allocator.free(s.role.held)
    s.memory.check_integrity()

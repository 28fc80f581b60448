"""The planner's decisions without processes: what it reads of the workers' /metrics (latency quantiles from the
buckets' growth, queues, KV use), each mode's pressures, flips with hysteresis, cooldown, margins and minimums,
and scaling. The /metrics texts are the ones workers render (recorded from servers, trimmed to what it reads)."""

from __future__ import annotations

import pytest

from planner.config import PlannerConfig
from planner.decide import Decider
from planner.observe import Observation, Observer, WorkerView, quantile

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def histogram(name: str, counts: dict[float, int]) -> str:
    """A cumulative histogram's buckets with `counts` observations at or below each bound."""
    lines, total = [f"# TYPE {name} histogram"], 0
    for bound in BOUNDS:
        total = max(total, counts.get(bound, total))
        lines.append(f'{name}_bucket{{le="{float(bound)}",role="decode"}} {float(total)}')
    lines.append(f'{name}_bucket{{le="+Inf",role="decode"}} {float(total)}')
    lines.append(f'{name}_count{{role="decode"}} {float(total)}')
    return "\n".join(lines) + "\n"


def decode_metrics(ttft: dict[float, int], itl: dict[float, int], used: int = 100, prealloc: int = 0) -> str:
    return (
        histogram("tandem_time_to_first_token_seconds", ttft)
        + histogram("tandem_inter_token_latency_seconds", itl)
        + f"""# TYPE tandem_kv_pages_used gauge
tandem_kv_pages_used{{role="decode"}} {used}
# TYPE tandem_kv_pages_total gauge
tandem_kv_pages_total{{role="decode"}} 512
# TYPE tandem_pd_queue_requests gauge
tandem_pd_queue_requests{{queue="prealloc",role="decode"}} {prealloc}
tandem_pd_queue_requests{{queue="transferring",role="decode"}} 1
"""
    )


def prefill_metrics(queue: int, rate: float = 2000.0, prompts: int = 0, finished: tuple[int, int] = (0, 0)) -> str:
    """A prefill's: `prompts` prompt tokens in the requests it finished, `finished` by reason (length, abort)."""
    return f"""# TYPE tandem_prefill_queue_tokens gauge
tandem_prefill_queue_tokens{{role="prefill"}} {queue}
# TYPE tandem_calibration_prefill_tokens_per_second gauge
tandem_calibration_prefill_tokens_per_second{{role="prefill"}} {rate}
# TYPE tandem_prompt_tokens_total counter
tandem_prompt_tokens_total{{role="prefill"}} {prompts}
# TYPE tandem_requests_finished_total counter
tandem_requests_finished_total{{reason="length",role="prefill"}} {finished[0]}
tandem_requests_finished_total{{reason="abort",role="prefill"}} {finished[1]}
"""


WORKERS = [
    WorkerView("http://p0", "prefill", 3),
    WorkerView("http://d0", "decode", 9),
    WorkerView("http://d1", "decode", 1),
]


def test_quantiles_come_from_what_the_buckets_gained():
    before = {0.1: 10.0, 0.5: 10.0, 1.0: 10.0, float("inf"): 10.0}
    after = {0.1: 10.0, 0.5: 20.0, 1.0: 30.0, float("inf"): 30.0}  # 10 new in (0.1, 0.5], 10 in (0.5, 1]
    assert quantile(0.5, before, after) == pytest.approx(0.5)
    assert quantile(0.9, before, after) == pytest.approx(0.5 + 0.5 * 0.8)
    assert quantile(0.9, after, after) is None  # nothing new


def test_the_observer_sums_each_role_and_reads_latency_between_two_reads():
    observer = Observer("http://router")
    first = {"http://p0": prefill_metrics(4000), "http://d0": decode_metrics({}, {}), "http://d1": None}
    obs = observer.summarize(WORKERS, first, now=1.0)
    assert (obs.prefill, obs.decode, obs.queue_s) == (1, 2, 2.0)  # 4000 tokens at 2000 tokens/s
    assert obs.ttft_p90_s is None and obs.kv_use == pytest.approx(100 / 512)  # d1 unread: not counted
    second = {
        "http://p0": prefill_metrics(0),
        "http://d0": decode_metrics({2.5: 10}, {0.05: 90, 0.1: 100}, used=300, prealloc=2),
        "http://d1": decode_metrics({1: 5}, {0.025: 50}),
    }
    obs = observer.summarize(WORKERS, second, now=2.0)
    assert obs.queue_s == 0 and obs.waiting_for_pages == 2
    # d0's 10 first tokens in (1, 2.5] s count; d1 was first read now, so its history does not
    assert obs.ttft_p90_s == pytest.approx(1 + 1.5 * 0.9)
    assert obs.itl_p90_s == pytest.approx(0.05 + 0.05 * 0.0)  # 90 of 100 within 50 ms
    assert obs.kv_use == pytest.approx((300 + 100) / 1024)


def test_the_predicted_ttft_is_the_queue_and_a_mean_prompt_at_the_measured_rate():
    observer = Observer("http://router")
    workers = [WorkerView("http://p0", "prefill", 0), WorkerView("http://p1", "prefill", 0), WORKERS[1]]
    first = {"http://p0": prefill_metrics(0, prompts=5000, finished=(4, 1)), "http://p1": prefill_metrics(0)}
    obs = observer.summarize(workers, first, now=1.0)
    assert obs.prompt_tokens == 0 and obs.ttft_predicted_s == 0  # nothing finished between two reads yet
    # in the interval: p0 finished 2 + 1 requests of 1500 prompt tokens in all, p1 one of 500
    second = {
        "http://p0": prefill_metrics(3000, prompts=6500, finished=(6, 2)),
        "http://p1": prefill_metrics(1000, prompts=500, finished=(1, 0)),
        "http://d0": decode_metrics({}, {}),
    }
    obs = observer.summarize(workers, second, now=2.0)
    assert obs.prompt_tokens == 500 and obs.queue_tokens == 4000 and obs.prefill_tokens_per_s == 4000
    assert obs.ttft_predicted_s == pytest.approx((4000 + 2 * 500) / 4000)  # the queue spread, then its own prompt
    obs = observer.summarize(workers, second, now=3.0)  # none finished: the mean stays
    assert obs.prompt_tokens == 500
    assert Observation(prefill=1, decode=1).ttft_predicted_s is None  # no rate known


def sla(**kw) -> PlannerConfig:
    return PlannerConfig(**{"mode": "sla", "ttft_ms": 1000, "itl_ms": 50, "hysteresis": 3, "cooldown_s": 30, **kw})


def obs(p: int, d: int, ttft: float | None, itl: float | None) -> Observation:
    return Observation(prefill=p, decode=d, ttft_p90_s=ttft, itl_p90_s=itl)


def test_a_flip_waits_for_its_hysteresis_then_for_the_cooldown():
    decider = Decider(sla())
    slow_ttft = obs(1, 3, 3.0, 0.01)  # prefill pressure 3, decode 0.2
    assert [decider.decide(slow_ttft, t).reason for t in (0, 1)] == ["hysteresis", "hysteresis"]
    decision = decider.decide(slow_ttft, 2)
    assert (decision.action, decision.prefill, decision.decode) == ("to_prefill", 2, 2)
    assert decision.pressure == {"prefill": 3.0, "decode": pytest.approx(0.2)}
    now_2_2 = obs(2, 2, 1.8, 0.01)  # still over: one more flip is wanted, but not within the cooldown
    assert [decider.decide(now_2_2, t).reason for t in (3, 4, 5)] == ["hysteresis", "hysteresis", "cooldown"]
    assert decider.decide(now_2_2, 40).action == "to_prefill"


def test_an_interval_back_under_target_resets_the_streak():
    decider = Decider(sla())
    for t, o in enumerate([obs(1, 3, 3.0, 0.01), obs(1, 3, 3.0, 0.01), obs(1, 3, 0.5, 0.01), obs(1, 3, 3.0, 0.01)]):
        decision = decider.decide(o, t)
    assert (decision.action, decision.reason) == ("none", "hysteresis")


def test_no_flip_below_the_minimums_or_without_gain():
    decider = Decider(sla(hysteresis=1))
    assert decider.decide(obs(1, 1, 3.0, 0.01), 0).reason == "min_servers"  # the only decode stays
    assert decider.decide(obs(1, 3, 0.1, 0.2), 0).reason == "min_servers"  # the only prefill stays
    # both over: moving a decode to prefill gives prefill 3 * 1/2 = 1.5 but decode 1.9 * 3/2 = 2.85 > 0.9 * 3
    assert decider.decide(obs(1, 3, 3.0, 0.095), 0).reason == "no_gain"
    assert decider.decide(obs(2, 2, 0.9, 0.2), 0).action == "to_decode"  # ITL 4x its target
    assert decider.decide(obs(2, 2, 0.9, 0.04), 0).reason == "steady"


def leftover(p: int, d: int, queue: float, itl: float, waiting: float = 0) -> Observation:
    """After a shift to short prompts: the first tokens of long prompts queued before it (30 s, target 10 s)."""
    return Observation(prefill=p, decode=d, ttft_p90_s=30.0, itl_p90_s=itl, queue_tokens=queue,
                       prefill_tokens_per_s=1000.0, prompt_tokens=64, waiting_for_pages=waiting)  # fmt: skip


def test_a_lagging_ttft_with_the_queue_drained_lets_the_decode_have_its_flip():
    """The observed TTFT alone keeps the prefill side the worse one (30 / 10 against ITL 2 / 1) and wants nothing
    (the last decode stays); with the queue drained the predicted TTFT (64 tokens at 500 per prefill: 0.128 s) is
    the prefill's, and the decode gets a prefill within the hysteresis."""
    decider = Decider(sla(ttft_ms=10000, itl_ms=250, hysteresis=2))
    unmeasured = leftover(2, 1, queue=0, itl=0.5)
    unmeasured.prefill_tokens_per_s = 0.0  # no prediction: the observation alone, as before the leading signals
    assert [decider.decide(unmeasured, t).reason for t in (0, 3, 6)] == ["min_servers"] * 3
    decisions = [decider.decide(leftover(2, 1, queue=0, itl=0.5), t) for t in (0, 3)]
    assert [d.reason for d in decisions] == ["hysteresis", "over_target"]
    assert (decisions[1].action, decisions[1].prefill, decisions[1].decode) == ("to_decode", 1, 2)
    assert decisions[1].pressure == {"prefill": pytest.approx(0.128 / 10), "decode": pytest.approx(2.0)}
    # the decode's ITL on target but 3 requests waiting for pages on it: its TTFT, which only decodes remove
    assert Decider(sla(ttft_ms=10000, itl_ms=250)).pressures(leftover(2, 1, 0, 0.1, waiting=3))["decode"] == 3.0


def test_a_queue_the_first_tokens_confirm_keeps_the_prefill_side():
    """20000 tokens queued (20 s at 1000 tokens/s, 20.128 s with a prompt) and first tokens at 30 s: both over the
    target, the smaller counts; with no first token in the interval the queue alone, nothing when idle."""
    decider = Decider(sla(ttft_ms=5000, itl_ms=250, hysteresis=1))
    assert decider.pressures(leftover(2, 1, queue=20000, itl=0.1))["prefill"] == pytest.approx(20.128 / 5)
    # the ITL over too (2), the prefill side worse (4): a decode would be moved to prefill but is the last one
    assert decider.decide(leftover(2, 1, queue=20000, itl=0.5), 0).reason == "min_servers"
    no_first_token = Observation(prefill=2, decode=1, queue_tokens=20000, prefill_tokens_per_s=1000, prompt_tokens=64)
    assert decider.pressures(no_first_token)["prefill"] == pytest.approx(20.128 / 5)
    idle = Observation(prefill=2, decode=1, prefill_tokens_per_s=1000, prompt_tokens=64)
    assert decider.pressures(idle) == {"prefill": 0.0, "decode": 0.0}


def test_throughput_and_latency_modes_read_queues_and_kv_use():
    o = Observation(prefill=1, decode=2, queue_tokens=3000, prefill_tokens_per_s=2000, kv_use=0.63, waiting_for_pages=2)
    assert Decider(PlannerConfig(mode="throughput")).pressures(o) == {
        "prefill": pytest.approx(1.5 / 2.0),
        "decode": pytest.approx(0.7),
    }
    assert Decider(PlannerConfig(mode="latency")).pressures(o) == {
        "prefill": pytest.approx(1.5 / 0.5),
        "decode": pytest.approx(1.0),  # 1 request waiting for pages per decode, latency's limit
    }


def test_scaling_sizes_each_role_within_its_bounds():
    config = PlannerConfig(mode="sla", ttft_ms=1000, itl_ms=50, actuator="scale", hysteresis=1, max_prefill=4)
    decision = Decider(config).decide(obs(2, 2, 3.0, 0.01), 0)  # prefill 3x over: 2 * 3 / 0.8 -> 8, capped at 4
    assert (decision.action, decision.prefill, decision.decode, decision.reason) == ("scale", 4, 1, "over_target")
    decision = Decider(config).decide(obs(3, 2, 0.2, 0.03), 0)  # prefill at 0.2: 3 * 0.2 / 0.8 -> 1
    assert (decision.prefill, decision.decode, decision.reason) == (1, 2, "under_target")


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        PlannerConfig(min_prefill=3, max_prefill=2)

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


def prefill_metrics(queue: int, rate: float = 2000.0) -> str:
    return f"""# TYPE tandem_prefill_queue_tokens gauge
tandem_prefill_queue_tokens{{role="prefill"}} {queue}
# TYPE tandem_calibration_prefill_tokens_per_second gauge
tandem_calibration_prefill_tokens_per_second{{role="prefill"}} {rate}
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

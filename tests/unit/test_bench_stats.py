"""`tandem bench` statistics against values computed by hand: percentiles (linear interpolation),
TPOT, throughput, goodput under SLOs."""

from __future__ import annotations

import pytest

from tandem.bench.client import RequestOutput
from tandem.bench.stats import distribution, meets_slos, summarize, tpot


def outputs() -> list[RequestOutput]:
    a = RequestOutput(success=True, ttft=0.1, itl=[0.05, 0.05, 0.2], latency=0.4, prompt_len=10, output_len=4)
    b = RequestOutput(success=True, ttft=0.3, itl=[0.1], latency=0.4, prompt_len=20, output_len=2, cached_tokens=16)
    c = RequestOutput(success=False, prompt_len=30, error="HTTP 503: full")
    return [a, b, c]


def test_distribution_interpolates_percentiles_in_ms():
    d = distribution("ttft", [4.0, 1.0, 3.0, 2.0])
    # sorted 1,2,3,4 s: p50 halfway between 2 and 3; p90 at rank 2.7 = 3 + 0.7; p99 at rank 2.97
    assert d == pytest.approx(
        {"mean_ttft_ms": 2500.0, "p50_ttft_ms": 2500.0, "p90_ttft_ms": 3700.0, "p99_ttft_ms": 3970.0}
    )
    assert distribution("itl", [0.25]) == {
        "mean_itl_ms": 250.0,
        "p50_itl_ms": 250.0,
        "p90_itl_ms": 250.0,
        "p99_itl_ms": 250.0,
    }
    assert distribution("itl", []) == {"mean_itl_ms": None, "p50_itl_ms": None, "p90_itl_ms": None, "p99_itl_ms": None}


def test_tpot_is_the_decode_time_per_token_after_the_first():
    assert tpot(RequestOutput(success=True, ttft=0.2, latency=1.0, output_len=5)) == pytest.approx(0.2)
    assert tpot(RequestOutput(success=True, ttft=0.2, latency=1.0, output_len=1)) is None


def test_summary_counts_only_successes_and_divides_by_the_duration():
    s = summarize(outputs(), duration=2.0, slos_ms={})
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 6)
    assert s["total_cached_tokens"] == 16  # only b reported it
    assert (s["request_throughput"], s["input_throughput"], s["output_throughput"], s["total_throughput"]) == (
        1.0,
        15.0,
        3.0,
        18.0,
    )
    assert s["first_error"] == "HTTP 503: full"
    assert "request_goodput" not in s
    # TTFT 0.1, 0.3 s; ITL pooled 0.05, 0.05, 0.1, 0.2 s; TPOT (0.4-0.1)/3 and (0.4-0.3)/1 = 0.1 s; E2E 0.4, 0.4 s
    assert s["p50_ttft_ms"] == pytest.approx(200.0) and s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["mean_itl_ms"] == pytest.approx(100.0) and s["p50_itl_ms"] == pytest.approx(75.0)
    assert s["p90_itl_ms"] == pytest.approx(170.0) and s["p99_itl_ms"] == pytest.approx(197.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0) and s["p99_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_e2e_latency_ms"] == pytest.approx(400.0)


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 200}, 1),  # a (100 ms) in, b (300 ms) out, c failed
        ({"itl": 150}, 1),  # a's longest gap is 200 ms: out; b's 100 ms: in
        ({"ttft": 350, "itl": 250}, 2),
        ({"tpot": 99}, 0),
        ({"e2e_latency": 450}, 2),
    ],
)
def test_goodput_counts_successes_within_every_slo(slos, good):
    s = summarize(outputs(), duration=4.0, slos_ms=slos)
    assert s["request_goodput"] == good / 4.0
    assert s["slo_attainment"] == good / 3
    assert sum(meets_slos(o, slos) for o in outputs()) == good


def test_an_all_failed_run_has_no_latencies():
    s = summarize([RequestOutput(error="refused")], duration=1.0, slos_ms={"ttft": 100})
    assert s["completed"] == 0 and s["failed"] == 1 and s["request_goodput"] == 0.0
    assert s["p99_ttft_ms"] is None and s["mean_e2e_latency_ms"] is None and s["total_cached_tokens"] is None

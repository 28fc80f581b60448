"""The placement's parts without processes: the cost of each path (router/placement/cost.py), what it picks with
recorded worker metrics (router/placement/worker_stats.py parses them), the two_way rule, the headers, the learned overhead
and tandem_router_placement_total."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.wire.errors import InvalidRequest
from router.metrics import RouterMetrics
from router.placement.cost import Overheads, Prompt, Side, Slo, local, remote
from router.placement.placer import Placer, pair_policy
from router.placement.rules import CostPlacement, PendingWork, TwoWay
from router.placement.worker_stats import Stats, WorkerStats, parse_metrics
from router.request_hints import NONE, RequestHints
from router.workers import WorkerRegistry

PAGE = 16


def metrics_text(extend_tokens=0.0, extend_s=0.0, decode_steps=0.0, decode_s=0.0, running=0, queue=0, free=500,
                 bytes_sent=0.0, write_s=0.0, cal_rate=4000.0, cal_step=0.02):  # fmt: skip
    """A worker's /metrics, as it renders the families the router reads."""
    return f"""# TYPE tandem_forward_tokens_total counter
tandem_forward_tokens_total{{mode="extend",role="decode"}} {extend_tokens}
tandem_forward_tokens_total{{mode="decode",role="decode"}} {decode_steps}
# TYPE tandem_forward_seconds_total counter
tandem_forward_seconds_total{{mode="extend",role="decode"}} {extend_s}
tandem_forward_seconds_total{{mode="decode",role="decode"}} {decode_s}
# TYPE tandem_forward_steps_total counter
tandem_forward_steps_total{{mode="decode",role="decode"}} {decode_steps}
# TYPE tandem_calibration_prefill_tokens_per_second gauge
tandem_calibration_prefill_tokens_per_second{{role="decode"}} {cal_rate}
# TYPE tandem_calibration_decode_step_seconds gauge
tandem_calibration_decode_step_seconds{{role="decode"}} {cal_step}
# TYPE tandem_prefill_queue_tokens gauge
tandem_prefill_queue_tokens{{role="decode"}} {queue}
# TYPE tandem_num_running_reqs gauge
tandem_num_running_reqs{{role="decode"}} {running}
# TYPE tandem_kv_pages_free gauge
tandem_kv_pages_free{{role="decode"}} {free}
# TYPE tandem_kv_pages_cached gauge
tandem_kv_pages_cached{{role="decode"}} 12
# TYPE tandem_kv_page_bytes gauge
tandem_kv_page_bytes{{role="decode"}} 1024
# TYPE tandem_prefill_chunk_tokens gauge
tandem_prefill_chunk_tokens{{role="decode"}} 256
# TYPE tandem_kv_transfer_events_total counter
tandem_kv_transfer_events_total{{event="bytes_sent",role="prefill"}} {bytes_sent}
# TYPE tandem_kv_transfer_write_seconds_total counter
tandem_kv_transfer_write_seconds_total{{role="prefill"}} {write_s}
"""


def test_the_stats_start_from_the_calibration_then_follow_the_counters():
    stats = Stats()
    stats.update(parse_metrics(metrics_text()), now=1.0)
    assert (stats.prefill_tokens_per_s, stats.decode_step_s) == (4000.0, 0.02)  # nothing ran: the calibration
    assert (stats.free_pages, stats.page_bytes, stats.chunk_tokens) == (512, 1024, 256)
    assert stats.wire_bytes_per_s is None  # never wrote
    stats.update(parse_metrics(metrics_text(1000, 0.5, 100, 1.0, bytes_sent=1e6, write_s=0.1)), now=2.0)
    assert stats.prefill_tokens_per_s == pytest.approx(0.7 * 4000 + 0.3 * 2000)  # blended: 2000 tokens/s measured
    assert stats.decode_step_s == pytest.approx(1 / (0.7 * 50 + 0.3 * 100))
    assert stats.wire_bytes_per_s == pytest.approx(1e7)
    stats.update(parse_metrics(metrics_text(1000, 0.5, 100, 1.0, bytes_sent=1e6, write_s=0.1)), now=3.0)
    assert stats.prefill_tokens_per_s == pytest.approx(0.7 * 4000 + 0.3 * 2000)  # an idle interval changes nothing


def test_a_first_scrape_of_a_busy_worker_takes_its_totals_as_one_interval():
    stats = Stats()
    stats.update(parse_metrics(metrics_text(3000, 1.0, 10, 0.5, running=3, queue=40)), now=1.0)
    assert (stats.prefill_tokens_per_s, stats.decode_step_s) == (3000.0, 0.05)
    assert (stats.running, stats.queue_tokens) == (3, 40)


FAST_P = Side(4000.0, 0.02, page_bytes=1024, wire_bytes_per_s=1e6)
DECODE = Side(2000.0, 0.02, running=8, free_pages=500, page_bytes=1024)


def test_remote_costs_queue_compute_and_wire_and_names_what_crosses():
    prompt = Prompt(2048, PAGE, 256)
    full = remote(prompt, 0, 0, FAST_P, DECODE, 0.01, Slo())
    assert full.path == "remote_full" and full.cross_bytes == 128 * 1024
    assert full.ttft_s == pytest.approx(0.01 + 2048 / 4000)
    assert full.wire_s == pytest.approx(128 * 1024 / 1e6)
    suffix = remote(prompt, 0, 1024, FAST_P, DECODE, 0.01, Slo())
    assert suffix.path == "remote_suffix" and suffix.cross_bytes == 64 * 1024
    assert suffix.cost < full.cost
    queued = remote(prompt, 0, 0, Side(4000.0, queue_tokens=4000), DECODE, 0.0, Slo())
    assert queued.ttft_s == pytest.approx(1.0 + 2048 / 4000)


def test_local_costs_its_compute_its_turns_with_the_batch_and_the_batch_s_wait():
    prompt = Prompt(1000, PAGE, 256)
    option = local(prompt, 200, DECODE, 0.0, Slo())
    compute = 800 / 2000
    assert option.ttft_s == pytest.approx(compute + 3 * 0.02)  # 4 chunks, a decode step between two
    assert option.interference_s == pytest.approx(8 * compute)  # each of the 8 running requests waits that long
    idle = local(prompt, 200, Side(2000.0, 0.02), 0.0, Slo())
    assert idle.ttft_s == pytest.approx(compute) and idle.interference_s == 0


def test_slo_targets_and_a_full_decode_count_as_misses():
    prompt = Prompt(2048, PAGE, 256)
    assert remote(prompt, 0, 0, FAST_P, DECODE, 0.0, Slo(ttft_s=0.1)).misses == 1  # 0.51 s > 100 ms
    assert remote(prompt, 0, 0, FAST_P, DECODE, 0.0, Slo(ttft_s=1.0)).misses == 0
    assert remote(prompt, 0, 0, FAST_P, DECODE, 0.0, Slo(tpot_s=0.01)).misses == 1  # its steps take 20 ms
    full = Side(2000.0, 0.02, free_pages=10)
    assert remote(prompt, 0, 0, FAST_P, full, 0.0, Slo()).misses == 1  # 128 pages do not fit in 10
    # a 256-token chunk (128 ms) between two tokens of a request that wants them 50 ms apart
    assert local(prompt, 0, DECODE, 0.0, Slo(running_tpot_s=0.05)).misses == 1
    assert local(Prompt(64, PAGE, 256), 0, DECODE, 0.0, Slo(running_tpot_s=0.1)).misses == 0


def test_the_overhead_is_the_mean_residual_then_a_moving_one():
    o = Overheads()
    assert o.get("remote") == 0.0
    o.observe("remote", 0.30, 0.10)
    o.observe("remote", 0.20, 0.10)
    assert o.get("remote") == pytest.approx(0.15)
    o.observe("remote", 0.05, 0.10)  # faster than predicted: no negative overhead
    assert 0 < o.get("remote") < 0.15 and o.get("local") == 0.0


def test_pending_work_expires_at_its_predicted_end():
    now = [0.0]
    pending = PendingWork(clock=lambda: now[0])
    pending.add("p", 100, 1.0)
    pending.add("p", 50, 3.0)
    assert pending.tokens("p") == 150
    now[0] = 2.0
    assert pending.tokens("p") == 50 and pending.tokens("q") == 0


def test_headers_parse_or_name_the_bad_one():
    h = RequestHints.from_headers({"x-bypass-remote-prefill": "True", "x-slo-ttft-ms": "250", "x-slo-tpot-ms": "40"})
    assert h == RequestHints(True, 0.25, 0.04) and h.priority() == 4000
    assert RequestHints.from_headers({}).priority() is None
    for headers, name in (
        ({"x-bypass-remote-prefill": "maybe"}, "x-bypass-remote-prefill"),
        ({"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms"),
        ({"x-slo-tpot-ms": "-5"}, "x-slo-tpot-ms"),
        ({"x-slo-tpot-ms": "nan"}, "x-slo-tpot-ms"),
    ):
        with pytest.raises(InvalidRequest) as e:
            RequestHints.from_headers(headers)
        assert e.value.param == name


class Index:
    """What the KV index says each worker holds of the one prompt these tests place, and its length."""

    def __init__(self, n: int, held: dict[str, int]):
        self.n, self.held_by = n, held

    def prompt_tokens(self, body):
        return self.n

    def page_size(self):
        return PAGE

    def held_tokens(self, worker, body):
        return self.held_by.get(worker.url, 0)

    def held(self, worker, body):
        return self.held_by.get(worker.url, 0) > 0

    def observe(self, prefill, decode, body):
        pass


def cluster(scrapes: dict[str, str]) -> tuple[WorkerRegistry, WorkerStats]:
    """Healthy workers p0, d0, d1 with stats from the recorded /metrics texts."""
    registry = WorkerRegistry(failure_threshold=1)
    for url, role in (("http://p0:1", "prefill"), ("http://d0:1", "decode"), ("http://d1:1", "decode")):
        registry.mark(registry.add(url, role), True)
    stats = WorkerStats(registry, 1.0)
    for url, text in scrapes.items():
        stats.stats.setdefault(url, Stats()).update(parse_metrics(text), now=1.0)
    return registry, stats


IDLE = metrics_text()
BUSY_DECODE = metrics_text(running=12)


def place(n: int, held: dict[str, int], scrapes: dict[str, str], hints: RequestHints = NONE):
    registry, stats = cluster(scrapes)
    placement = CostPlacement(Index(n, held), stats)
    metrics = RouterMetrics(registry, lambda: 0)
    placer = Placer(registry, pair_policy("round_robin", None, kv=None), None, placement, metrics)
    pair = placer.pick({}, hints=hints)
    return pair, metrics


def test_the_cost_keeps_a_cached_conversation_on_its_decode_and_a_long_prompt_off_a_busy_one():
    scrapes = {"http://p0:1": IDLE, "http://d0:1": BUSY_DECODE, "http://d1:1": BUSY_DECODE}
    # a conversation's next turn: d0 holds 960 of its 1000 tokens; 40 tokens cost the batch 12 x 10 ms
    pair, _ = place(1000, {"http://d0:1": 960}, scrapes)
    assert (pair.prefill, pair.decode.url, pair.path, pair.reason) == (None, "http://d0:1", "local", "least_cost")
    # a 2k prompt held nowhere: half a second of compute would stall 12 running requests: the prefill computes it
    pair, _ = place(2048, {}, scrapes)
    assert pair.prefill.url == "http://p0:1" and pair.path == "remote_full"


def test_a_ttft_target_moves_the_prompt_where_it_is_met():
    # the prefill's queue holds 8000 tokens (2 s): cheaper in total to wait there than to stall a decode's batch of
    # 12 for half a second, but a 1 s TTFT target is only met on the decode itself (0.51 s and 7 turns of 20 ms)
    scrapes = {"http://p0:1": metrics_text(queue=8000), "http://d0:1": BUSY_DECODE, "http://d1:1": BUSY_DECODE}
    pair, metrics = place(2048, {}, scrapes)
    assert pair.prefill is not None
    pair, metrics = place(2048, {}, scrapes, RequestHints(ttft_s=1.0))
    assert pair.prefill is None and pair.reason == "slo"
    text = metrics.render().decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "tandem_router_placement"]
    assert {(s.labels["path"], s.labels["reason"]): s.value for s in family.samples if s.name.endswith("_total")} == {
        ("local", "slo"): 1.0
    }


def test_bypass_forces_local_and_no_prefill_means_local_or_none():
    registry, stats = cluster({})
    two_way = TwoWay(pair_policy("round_robin", None, kv=None), Index(100, {}), threshold=64)
    placer = Placer(registry, pair_policy("round_robin", None, kv=None), None, two_way)
    assert placer.pick({}, hints=RequestHints(bypass_remote_prefill=True)).reason == "forced"
    pair = placer.pick({})
    assert pair.prefill is not None and pair.reason == "threshold"  # 100 uncached tokens >= 64
    registry.mark(registry.workers["http://p0:1"], False)
    assert placer.pick({}).reason == "no_prefill"
    assert Placer(registry, pair_policy("round_robin", None, kv=None)).pick({}) is None  # remote needs a prefill


def test_two_way_goes_local_when_the_decode_lacks_little():
    registry, _ = cluster({})
    rule = TwoWay(pair_policy("round_robin", None, kv=None), Index(300, {"http://d0:1": 256}), threshold=64)
    pair = Placer(registry, pair_policy("round_robin", None, kv=None), None, rule).pick({})
    assert (pair.prefill, pair.decode.url, pair.path) == (None, "http://d0:1", "local")

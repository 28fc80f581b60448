"""The per-request timeline through a real PD cluster (router, prefill, decode; Mooncake): one DEBUG line
per request on each half, whose steps line up across the two processes in the order the protocol
allows, and the same steps counted in each server's tandem_request_span_seconds histogram."""

from __future__ import annotations

import json

import httpx
import pytest

from common.core.timeline import parse
from tests.conftest import metric
from tests.integration.cluster import start_cluster
from tests.integration.faults import wait_until

FLAGS = ("--page-size", "16", "--chunked-prefill-size", "32")
N = 3
# (earlier, later): each pair in protocol order, "half.event"; both halves run on this host's monotonic clock.
# The prefill computes while the decode pairs: only its chunks wait for the room request. The first token
# goes to the decode ahead of the KV, so the decode may stream it before the status arrives.
ORDER = [
    ("decode.arrival", "decode.admitted"),
    ("decode.admitted", "decode.peer_found"),
    ("decode.peer_found", "decode.pages_reserved"),
    ("decode.pages_reserved", "decode.room_request_sent"),
    ("decode.room_request_sent", "prefill.room_request_received"),
    ("prefill.admitted", "prefill.prefill_start"),
    ("prefill.room_request_received", "prefill.chunk_queued"),
    ("prefill.prefill_start", "prefill.forward_done"),
    ("prefill.forward_done", "prefill.chunk_queued"),
    ("prefill.chunk_queued", "prefill.chunk_written"),
    ("prefill.chunk_written", "prefill.aux_written"),
    ("prefill.aux_written", "prefill.status_sent"),
    ("prefill.status_sent", "decode.status_received"),
    ("prefill.first_token_sent", "decode.first_token_committed"),
    ("prefill.forward_done", "prefill.first_token_sent"),
    ("decode.first_token_committed", "decode.first_token_streamed"),
]


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_LOG_LEVEL", "DEBUG")  # the servers log their timelines
        c = start_cluster("mooncake", flags=FLAGS)
    yield c
    c.stop()


def timeline_of(server, rid: str) -> dict[str, float]:
    for line in server.log_path.read_text(errors="replace").splitlines():
        parsed = parse(line)
        if parsed is not None and parsed[0] == rid:
            return dict(parsed[2])  # the last occurrence of each event (chunks repeat)
    return {}


def test_both_halves_log_their_steps_in_protocol_order_and_count_them(cluster):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    for i in range(N):
        body = {
            "rid": f"timeline-{i}",
            "input_ids": list(range(100 + i, 170 + i)),
            "stream": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        }
        with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=120) as r:
            assert r.status_code == 200
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        last = json.loads(chunks[-1].removeprefix("data: "))
        assert last["meta_info"]["completion_tokens"] == 3 and last["meta_info"]["prompt_tokens"] == 70, last
    for i in range(N):
        rid = f"timeline-{i}"
        wait_until(lambda: timeline_of(prefill, rid) and timeline_of(decode, rid), 10, f"both halves to log {rid}")
        steps = {f"prefill.{k}": v for k, v in timeline_of(prefill, rid).items()}
        steps |= {f"decode.{k}": v for k, v in timeline_of(decode, rid).items()}
        for earlier, later in ORDER:
            assert steps[earlier] <= steps[later], (rid, earlier, later, steps)
    for server, spans in (
        (prefill, ("room_request_received", "prefill_start", "first_token_sent", "chunk_written", "aux_written")),
        (decode, ("peer_found", "pages_reserved", "room_request_sent", "status_received", "first_token_streamed")),
    ):
        for span in spans:
            assert metric(server.url, "tandem_request_span_seconds_count", span=span) == N, (server.name, span)
    cluster.wait_idle()

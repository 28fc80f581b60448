"""Router pieces without processes: config from flags and environment, worker health bookkeeping,
SSE framing, upstream error bodies, forwarded bodies, merged prompt logprobs."""

from __future__ import annotations

import json

import pytest

from common.wire.sse import sse_event
from router.dispatch import forward_bodies
from router.logprobs import PromptLogprobs
from router.pair_call import Pair
from router.pair_stream import SSEFramer
from router.placement.placer import Placer, pair_policy
from router.placement.policies import POLICIES
from router.upstream import DECODE_FAILED, answered_error
from router.workers import WorkerRegistry
from tandem.router_cli import config_from_args
from tests.conftest import ROOT


def test_flags_win_over_environment_and_environment_over_defaults(monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_MAX_CONCURRENT_REQUESTS", "7")
    monkeypatch.setenv("TANDEM_ROUTER_HEALTH_CHECK_TIMEOUT_S", "0.5")
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    config = config_from_args(
        [
            "--prefill",
            "http://p:1/",
            "9000",
            "--prefill",
            "http://q:2",
            "--decode",
            "http://d:3/",
            "--max-concurrent-requests",
            "3",
        ]
    )
    assert config.max_concurrent_requests == 3 and config.health_check_timeout_s == 0.5 and config.api_key == "from-env"
    assert [(p.url, p.bootstrap_port) for p in config.prefill] == [("http://p:1", 9000), ("http://q:2", 8998)]
    assert (
        config.decode == ["http://d:3"]
        and config.health_failure_threshold == 2
        and config.health_check_interval_s == 5.0
    )


def test_decode_policy_is_its_own_flag_and_defaults_to_none(capsys):
    assert config_from_args([]).decode_policy is None
    assert config_from_args(["--decode-policy", "cache_aware"]).decode_policy == "cache_aware"
    with pytest.raises(SystemExit):
        config_from_args(["--decode-policy", "fastest"])
    assert "argument --decode-policy: invalid choice: 'fastest' (choose from 'random', " in capsys.readouterr().err


def test_every_policy_is_a_flag_choice_and_a_row_of_the_readme():
    """router/placement/policies.py's registry is the one list: the flags' choices and the README's table come from it."""
    readme = (ROOT / "README.md").read_text()
    for name, spec in POLICIES.items():
        assert config_from_args(["--policy", name, "--decode-policy", name]).decode_policy == name
        assert f"| `{name}` | {spec.summary} |" in readme, name


def test_the_placer_picks_among_healthy_workers_not_excluded():
    registry = WorkerRegistry(failure_threshold=1)
    p0, p1, d0, d1 = (
        registry.add(f"http://{n}:1", role)
        for n, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
    )
    for w in (p0, p1, d0, d1):
        registry.mark(w, True)
    registry.mark(p0, False)
    placer = Placer(registry, pair_policy("round_robin", None, kv=None))
    assert [placer.pick({}) for _ in range(2)] == [Pair(p1, d0), Pair(p1, d1)]
    assert placer.pick({}, exclude={d0.url}) == Pair(p1, d1)
    assert placer.pick({}, exclude={p1.url}) is None and placer.pick({}, exclude={d0.url, d1.url}) is None


def test_bad_values_are_refused(monkeypatch):
    with pytest.raises(ValueError):
        config_from_args(["--health-failure-threshold", "0"])
    monkeypatch.setenv("TANDEM_ROUTER_POLICY", "fastest")
    with pytest.raises(ValueError):
        config_from_args([])


class RecordingCall:
    """A request in flight, as the registry sees it: it only needs to be told when its worker goes down."""

    def __init__(self) -> None:
        self.ended_by: list[str] = []

    def worker_down(self, worker) -> None:
        self.ended_by.append(worker.down_reason)


def test_a_worker_leaves_rotation_at_the_threshold_ending_its_calls_and_returns_when_healthy():
    registry = WorkerRegistry(failure_threshold=2)
    w = registry.add("http://d:1/", "decode")
    registry.mark(w, True)
    call = RecordingCall()
    w.calls.add(call)
    registry.mark(w, False, "GET /health timed out after 2 s")
    assert w.healthy and call.ended_by == [] and w.failures == 1
    registry.mark(w, False, "GET /health timed out after 2 s")
    assert not w.healthy and registry.healthy("decode") == []
    assert w.down_reason == (
        "decode worker http://d:1 failed health checks and was taken out of rotation "
        "(2 failures in a row; the last: GET /health timed out after 2 s)"
    )
    assert call.ended_by == [w.down_reason]
    w.calls.discard(call)  # what the call does when it closes
    registry.mark(w, True)
    assert w.healthy and w.failures == 0 and w.down_reason == ""
    later = RecordingCall()
    w.calls.add(later)
    registry.mark(w, False, "GET /health answered HTTP 500")
    assert later.ended_by == [] and call.ended_by == [call.ended_by[0]]  # one failure: still in rotation
    assert w.to_dict() == {
        "url": "http://d:1",
        "role": "decode",
        "bootstrap_port": None,
        "bootstrap_host": None,
        "healthy": True,
        "failures": 1,
        "in_flight": 0,
    }


def test_sse_framer_passes_whole_events_only_and_notices_done():
    framer = SSEFramer()
    assert framer.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert framer.feed(b": 2}\n") == b""
    assert framer.feed(b"\ndata: [DONE]\n\n") == b'data: {"b": 2}\n\ndata: [DONE]\n\n' and framer.saw_done


def test_a_worker_error_body_passes_through_and_anything_else_is_wrapped():
    w = WorkerRegistry(2).add("http://d:1", "decode")
    own = answered_error(
        w, 503, b'{"error": {"message": "full", "type": "overloaded_error", "code": 503, "param": null}}'
    )
    assert own.body["error"]["message"] == "full" and own.retriable and own.cause == DECODE_FAILED
    other = answered_error(w, 404, b'{"detail": "Not Found"}')
    assert other.body == {
        "error": {
            "message": 'decode worker http://d:1 answered HTTP 404: {"detail": "Not Found"}',
            "type": "upstream_error",
            "code": 404,
            "param": None,
        }
    }
    assert not other.retriable


def test_forwarded_bodies_are_the_clients_bytes_plus_bootstrap_fields_which_win():
    raw = b'{"text": "hi", "stream": true, "bootstrap_room": 1}  \n'
    body = json.loads(raw)
    forwarded = body | {"bootstrap_host": "h", "bootstrap_room": 7}
    prefill, decode = forward_bodies(raw, body, forwarded)
    assert decode.startswith(raw[: raw.rindex(b"}")])  # not encoded anew
    assert json.loads(decode) == forwarded and json.loads(prefill) == forwarded | {"stream": False}
    assert forward_bodies(b"{}", {}, {"bootstrap_room": 7}) == (b'{"bootstrap_room":7}', b'{"bootstrap_room":7}')
    # a field of the client's that must go (an instance id the router did not learn): encoded anew
    body = {"text": "hi", "prefill_instance_id": "forged"}
    prefill, decode = forward_bodies(json.dumps(body).encode(), body, {"text": "hi", "bootstrap_room": 7})
    assert json.loads(decode) == json.loads(prefill) == {"text": "hi", "bootstrap_room": 7}


def test_prompt_logprobs_go_into_every_generate_event_and_the_first_completion_event_of_each_choice():
    lps = [[None, 5, None], [-0.5, 6, None]]
    gen = PromptLogprobs("/generate", json.dumps({"meta_info": {"input_token_logprobs": lps}}).encode())
    events = gen.events(
        b'data: {"meta_info": {"input_token_logprobs": [[null, 5, null], [null, 6, null]]}, "index": 0}\n\n'
        b'data: {"error": {"message": "m"}}\n\ndata: [DONE]\n\n'
    )
    first, error, done = events.split(b"\n\n")[:3]
    assert json.loads(first[6:])["meta_info"]["input_token_logprobs"] == lps
    assert (error, done) == (b'data: {"error": {"message": "m"}}', b"data: [DONE]")
    prefill = {
        "choices": [
            {
                "index": 0,
                "logprobs": {"token_logprobs": [None, -0.5, -0.1], "top_logprobs": [None, {"a": -0.5}, {"b": -0.1}]},
            }
        ],
        "usage": {"prompt_tokens": 2},
    }
    comp = PromptLogprobs("/v1/completions", json.dumps(prefill).encode())
    first = {
        "choices": [
            {"index": 0, "logprobs": {"token_logprobs": [None, None, -0.2], "top_logprobs": [None, {}, {"c": -0.2}]}}
        ]
    }
    later = {"choices": [{"index": 0, "logprobs": {"token_logprobs": [None], "top_logprobs": [{}]}}]}
    merged = [json.loads(e[6:]) for e in comp.events(sse_event(first) + sse_event(later)).split(b"\n\n")[:2]]
    assert merged[0]["choices"][0]["logprobs"] == {
        "token_logprobs": [None, -0.5, -0.2],
        "top_logprobs": [None, {"a": -0.5}, {"c": -0.2}],
    }
    assert merged[1] == later  # the prompt came with the first event only

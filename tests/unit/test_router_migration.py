"""The router's side of migration without processes (router/migration.py): the decode's token trace read and
stripped, what the next pair is told the client has (resume), which failures move a request and which
worker the next pair avoids."""

from __future__ import annotations

import json

from common.wire.errors import error_body
from common.wire.migration import trace
from common.wire.sse import sse_event
from router.config import RouterConfig
from router.migration import Moves, choices
from router.upstream import CLIENT_ERROR, DECODE_FAILED, PREFILL_FAILED, UpstreamError
from router.workers import Worker

PREFILL, DECODE = Worker("http://p:1", "prefill"), Worker("http://d:1", "decode")


def moves(path: str = "/v1/chat/completions", body: dict | None = None, **config) -> Moves:
    return Moves(RouterConfig(**config), path, {"n": 2} if body is None else body)


def test_traces_are_read_and_stripped_and_the_next_pair_told_what_the_client_has():
    m = moves()
    assert m.fields()["migration"].keys() == {"rid", "created", "seed", "handover"}  # first try: no resume
    role = trace(0, [], prompt_len=12) + sse_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    held = trace(0, [5]) + b"\n"  # a token whose text is held back: an event of its own, nothing for the client
    shown = trace(0, [6, 7]) + sse_event({"choices": [{"index": 0, "delta": {"content": "ab"}}]})
    out, error = m.observe(role + held + shown, DECODE)
    assert error is None and b"trace" not in out and out.count(b"data: ") == 2
    resume = m.fields()["migration"]["resume"]
    assert resume == [{"output_ids": [5, 6, 7], "finished": False}, None]  # choice 1: nothing shown yet
    assert m.prompt_len == 12


def test_a_generate_choice_resumes_with_the_text_and_logprobs_shown():
    m = moves("/generate", {"sampling_params": {"n": 1}})
    event = {"text": "ab", "output_ids": [6, 7], "meta_info": {"output_token_logprobs": [[-0.1, 6, None]]}}
    m.observe(trace(0, [6, 7], finished=True) + sse_event(event | {"index": 0}), DECODE)
    assert m.fields()["migration"]["resume"] == [
        {"output_ids": [6, 7], "finished": True, "text": "ab", "output_token_logprobs": [[-0.1, 6, None]]}
    ]


def test_an_error_event_ends_the_events_before_it_are_kept_and_its_cause_is_read():
    m = moves()
    ok = trace(0, [1]) + sse_event({"choices": [{"index": 0, "delta": {"content": "a"}}]})
    for code, cause in ((502, PREFILL_FAILED), (504, PREFILL_FAILED), (503, DECODE_FAILED), (400, CLIENT_ERROR)):
        event = sse_event(error_body("no", "x", code))
        out, error = m.observe(ok + event + b"data: [DONE]\n\n", DECODE)
        assert out.count(b"data: ") == 1 and (error.status, error.cause) == (code, cause)


def test_what_moves_a_request_and_what_the_next_pair_avoids():
    def failure(cause: str, worker: Worker = DECODE) -> UpstreamError:
        return UpstreamError(502, error_body("x", "upstream_error", 502), cause, worker)

    m = moves(migration_limit=2)
    assert m.again(failure(CLIENT_ERROR), PREFILL, DECODE) is None
    assert m.again(failure(PREFILL_FAILED), PREFILL, DECODE) == PREFILL_FAILED  # a decode's event about its peer
    assert m.again(failure(DECODE_FAILED), PREFILL, DECODE) == DECODE_FAILED
    assert m.exclude == {PREFILL.url, DECODE.url}
    assert m.again(failure(DECODE_FAILED), PREFILL, DECODE) is None  # the limit
    assert moves(migration_limit=0).again(failure(DECODE_FAILED), PREFILL, DECODE) is None


def test_a_request_whose_client_has_everything_or_is_too_long_does_not_move():
    done = moves(body={})
    done.observe(trace(0, [1], prompt_len=4, finished=True) + sse_event({"choices": []}), DECODE)
    error = UpstreamError(502, error_body("x", "upstream_error", 502), DECODE_FAILED, DECODE)
    assert done.again(error, PREFILL, DECODE) is None
    long = moves(body={}, migration_max_seq_len=4)
    long.observe(trace(0, [1], prompt_len=4) + sse_event({"choices": []}), DECODE)
    assert long.again(error, PREFILL, DECODE) is None


def test_the_number_of_choices_is_read_as_the_workers_read_it():
    assert choices("/generate", {"sampling_params": {"n": 3}}) == 3
    assert choices("/generate", {"sampling_params": 5, "n": 4}) == 1
    assert choices("/v1/completions", {"n": True}) == 1
    assert choices("/v1/chat/completions", json.loads('{"n": 16}')) == 16

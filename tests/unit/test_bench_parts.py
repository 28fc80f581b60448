"""`tandem bench` pieces without a server: stream parsing per backend, request bodies, workloads,
arrival times, flag errors."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tandem.bench.client import RequestOutput, StreamError, StreamState
from tandem.bench.endpoint import Endpoint
from tandem.bench.flags import add_bench_flags
from tandem.bench.tokenizer import load_tokenizer
from tandem.bench.workload import BenchRequest, Workload, arrival_times, build_workload


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


def fold(backend: str, events: list[dict], times: list[float]) -> RequestOutput:
    state = StreamState(RequestOutput(prompt_len=99), backend, start=10.0)
    for event, now in zip(events, times):
        state.on_event(event, now)
    return state.finish(times[-1] + 0.5)


def test_openai_stream_times_text_chunks_and_takes_counts_from_usage():
    events = [
        {"choices": [{"text": "a"}]},
        {"choices": [{"text": ""}]},
        {"choices": [{"text": "b"}]},
        {"choices": [{"text": "c", "finish_reason": "length"}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 7, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}},
        },
    ]
    out = fold("openai", events, [10.25, 10.3, 10.5, 11.0, 11.0])
    assert out.success and out.ttft == 0.25 and out.itl == [0.25, 0.5] and out.latency == 1.5
    assert (out.prompt_len, out.output_len, out.cached_tokens) == (7, 4, 2)


def test_chat_stream_without_usage_counts_content_chunks():
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "x"}}]},
        {"choices": [{"delta": {"content": "y"}}]},
        {"choices": [{"delta": {}, "finish_reason": "stop"}]},
    ]
    out = fold("openai-chat", events, [10.1, 10.5, 10.75, 10.8])
    assert (
        out.ttft == 0.5 and out.itl == [0.25] and (out.prompt_len, out.output_len, out.cached_tokens) == (99, 2, None)
    )


def test_sglang_stream_counts_tokens_from_cumulative_meta_info():
    meta = {"prompt_tokens": 5, "cached_tokens": 0}
    events = [
        {"text": "a", "meta_info": meta | {"completion_tokens": 1}},
        {"text": "a", "meta_info": meta | {"completion_tokens": 1}},
        {"text": "ab", "meta_info": meta | {"completion_tokens": 3}},
    ]
    out = fold("sglang", events, [10.5, 10.6, 11.0])
    assert out.ttft == 0.5 and out.itl == [0.5] and (out.prompt_len, out.output_len, out.cached_tokens) == (5, 3, 0)
    assert (out.text, out.output_ids) == ("ab", None)
    out = fold("sglang", [{"text": "a", "output_ids": [7], "meta_info": meta | {"completion_tokens": 1}}], [10.5])
    assert (out.text, out.output_ids) == ("a", [7])  # a multi-turn conversation's next prompt takes these


def test_an_error_event_or_an_empty_stream_fails_the_request():
    state = StreamState(RequestOutput(), "openai", start=0.0)
    with pytest.raises(StreamError, match="queue full"):
        state.on_event({"error": {"message": "queue full", "code": 503}}, 1.0)
    with pytest.raises(StreamError, match="without a token"):
        StreamState(RequestOutput(), "sglang", start=0.0).finish(1.0)


def test_bodies_speak_each_backend():
    req = BenchRequest([5, 6, 7], "hi there", 4)
    sglang = Endpoint("http://h:1/", "sglang", None, token_ids=True, extra={"rid": "x"}).body(req)
    assert Endpoint("http://h:1/", "sglang", None, token_ids=True).url == "http://h:1/generate"
    assert sglang == {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
        "rid": "x",
    }
    openai = Endpoint("http://h:1", "openai", "m", token_ids=True, ignore_eos=False)
    assert openai.url == "http://h:1/v1/completions"
    assert openai.body(req) == {
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "model": "m",
        "prompt": [5, 6, 7],
    }
    chat = Endpoint("http://h:1", "openai-chat", None, token_ids=False).body(req, stream=False)
    assert chat == {
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": False,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi there"}],
    }


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_flags(p)
    return p.parse_args(list(argv))


def test_random_lengths_are_exact_or_uniform_and_seeded(tokenizer):
    ns = parse("--num-prompts", "5", "--random-input-len", "40", "--random-output-len", "6")
    reqs = build_workload(ns, Workload(tokenizer, ns.seed))
    assert [(len(r.prompt_ids), r.output_len) for r in reqs] == [(40, 6)] * 5
    assert reqs == build_workload(ns, Workload(tokenizer, ns.seed))
    special = set(tokenizer.get_added_tokens_decoder())
    assert not special & {t for r in reqs for t in r.prompt_ids}
    ns = parse("--num-prompts", "200", "--random-input-len", "40", "--random-range-ratio", "0.5")
    lengths = {len(r.prompt_ids) for r in build_workload(ns, Workload(tokenizer, 3))}
    assert min(lengths) == 20 and max(lengths) == 40


def test_every_call_draws_new_prompts(tokenizer):
    w, ns = Workload(tokenizer, 1), parse("--num-prompts", "2", "--random-input-len", "8")
    assert build_workload(ns, w) != build_workload(ns, w)


def test_sharegpt_mix_has_a_long_tail_within_the_context(tokenizer):
    ns = parse("--dataset-name", "sharegpt", "--num-prompts", "300", "--sharegpt-context-len", "1024")
    reqs = build_workload(ns, Workload(tokenizer, 0))
    inputs = sorted(len(r.prompt_ids) for r in reqs)
    assert all(len(r.prompt_ids) + r.output_len <= 1024 and len(r.prompt_ids) >= 4 for r in reqs)
    assert 50 < inputs[150] < 200 and inputs[-1] > 500  # median near 100 tokens, a tail of long prompts


def test_shared_prefix_groups_share_exactly_their_system_prompt(tokenizer):
    ns = parse(
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "3",
        "--gsp-prompts-per-group",
        "4",
        "--gsp-system-prompt-len",
        "20",
        "--gsp-question-len",
        "5",
        "--gsp-output-len",
        "2",
    )
    reqs = build_workload(ns, Workload(tokenizer, 0))
    assert len(reqs) == 12 and {(len(r.prompt_ids), r.output_len) for r in reqs} == {(25, 2)}
    prefixes = [tuple(r.prompt_ids[:20]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({tuple(r.prompt_ids[20:]) for r in reqs}) == 12


def test_jsonl_prompts_are_tokenized_and_bad_lines_named(tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "hello world", "output_len": 3}) + "\n\n" + json.dumps({"prompt": "hi"}) + "\n"
    )
    ns = parse("--dataset-name", "jsonl", "--dataset-path", str(path), "--random-output-len", "9")
    reqs = build_workload(ns, Workload(tokenizer, 0))
    assert [(r.prompt_ids, r.output_len) for r in reqs] == [
        (tokenizer.encode("hello world", add_special_tokens=False).ids, 3),
        (tokenizer.encode("hi", add_special_tokens=False).ids, 9),
    ]
    path.write_text('{"prompt": "ok"}\n{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(SystemExit, match='line 2: "output_len" must be an integer >= 1'):
        build_workload(ns, Workload(tokenizer, 0))
    with pytest.raises(SystemExit, match="needs --dataset-path"):
        build_workload(parse("--dataset-name", "jsonl"), Workload(tokenizer, 0))


def test_arrivals_are_poisson_at_the_rate_and_the_same_for_the_same_seed():
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(4000, 8.0, 5)
    assert times[0] == 0.0 and all(a <= b for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 8.0, rel=0.05)
    assert arrival_times(50, 8.0, 5) == times[:50] and arrival_times(50, 8.0, 6) != times[:50]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--goodput", "ttfb:100"],
            "argument --goodput: 'ttfb:100': the metric must be one of ttft, itl, tpot, e2e_latency",
        ),
        (["--goodput", "ttft:fast"], "argument --goodput: 'ttft:fast': give milliseconds after the colon"),
        (["--request-rate", "0"], "argument --request-rate: '0': must be > 0 (or inf)"),
        (["--random-range-ratio", "1.5"], "argument --random-range-ratio: '1.5': must be between 0 and 1"),
        (["--extra-request-body", "[1]"], "argument --extra-request-body: must be a JSON object"),
        (["--num-prompts", "0"], "argument --num-prompts: '0': must be >= 1"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_tokenizer_from_a_directory_and_mistakes_named(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).encode("hello world").ids == tokenizer.encode("hello world").ids
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="--tokenizer .*empty: a directory without config.json; give a Hugging Face"):
        load_tokenizer(str(tmp_path / "empty"))

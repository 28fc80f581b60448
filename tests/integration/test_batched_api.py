"""Batched prompts and the tokenizer/info endpoints, as vLLM's and SGLang's users send them, on a monolithic server
and through the PD router: the OpenAI SDK's completions.create(prompt=[...]) and SGLang's /generate with a list
answer what the prompts sent one by one answer (greedy: text and token ids exactly), choices numbered
prompt_i * n + j with usage summed; a server streams a list (the router refuses it, naming `stream`); a client
that leaves mid-batch leaves every page free; /tokenize, /detokenize, /version and /get_model_info answer."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import metric
from tests.integration.test_responses_api import client, cluster, model, mono  # noqa: F401 (fixtures: a shared cluster)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    for name in ("mono", "cluster"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle()


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir):
    return AutoTokenizer.from_pretrained(builtin_model_dir)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def max_model_len(server) -> int:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]


def one_by_one(server, prompts: list, **kw) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client(server).completions.create(prompt=p, **kw), prompts))


@pytest.mark.parametrize("where", ["mono", "cluster"])
@pytest.mark.parametrize("prompts", [PROMPTS, [[11, 12, 13], [40, 41], [7]]], ids=["text", "token_ids"])
def test_a_list_of_prompts_answers_what_each_prompt_does(request, where, prompts, model):
    server = request.getfixturevalue(where)
    batch = client(server).completions.create(model=model, prompt=prompts, n=2, **GREEDY)
    singles = one_by_one(server, prompts, model=model, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(2 * len(prompts)))
    assert [c.text for c in batch.choices] == [c.text for s in singles for c in s.choices]
    assert [c.finish_reason for c in batch.choices] == [c.finish_reason for s in singles for c in s.choices]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 6 * 2 * len(prompts)


@pytest.mark.parametrize("where", ["mono", "cluster"])
def test_generate_with_a_list_answers_a_list_in_order(request, where):
    server = request.getfixturevalue(where)
    params = [{"temperature": 0, "max_new_tokens": k} for k in (3, 5, 4)]
    batch = post(server, "/generate", {"text": PROMPTS, "sampling_params": params})
    assert batch.status_code == 200, batch.text
    singles = [post(server, "/generate", {"text": t, "sampling_params": p}).json() for t, p in zip(PROMPTS, params)]
    assert [r["output_ids"] for r in batch.json()] == [s["output_ids"] for s in singles]
    assert [len(r["output_ids"]) for r in batch.json()] == [3, 5, 4]
    ids = post(server, "/generate", {"input_ids": [s["output_ids"] for s in singles], "sampling_params": params[0]})
    assert [len(r["output_ids"]) for r in ids.json()] == [3, 3, 3]


def test_a_server_streams_a_list_with_each_chunk_indexed(mono, model):
    streamed = {}
    for chunk in client(mono).completions.create(model=model, prompt=PROMPTS, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    plain = client(mono).completions.create(model=model, prompt=PROMPTS, **GREEDY)
    assert streamed == {c.index: c.text for c in plain.choices}
    events = post(mono, "/generate", {"text": PROMPTS[:2], "stream": True, "sampling_params": {"max_new_tokens": 4}})
    assert events.text.count("data: [DONE]") == 1 and '"index": 1' in events.text.replace('"index":1', '"index": 1')


def test_the_router_refuses_to_stream_a_list_naming_stream(cluster):
    r = post(cluster, "/v1/completions", {"prompt": PROMPTS, "stream": True})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "stream")


@pytest.mark.parametrize("where", ["mono", "cluster"])
def test_a_prompt_too_long_fails_the_batch_naming_its_index(request, where):
    server = request.getfixturevalue(where)
    r = post(server, "/v1/completions", {"prompt": ["short", "word " * 5000], "max_tokens": 4})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt.1"), r.text
    assert r.json()["error"]["message"].startswith("prompt.1 ")


@pytest.mark.parametrize("where", ["mono", "cluster"])
def test_a_client_leaving_mid_batch_aborts_every_prompt_and_frees_every_page(request, where):
    server = request.getfixturevalue(where)
    nodes = getattr(server, "nodes", [server])
    aborted = lambda: sum(metric(n.url, "tandem_requests_finished_total", reason="abort") for n in nodes)  # noqa: E731
    before = aborted()
    body = {"prompt": PROMPTS * 2, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    server.wait_idle()
    assert aborted() - before >= len(body["prompt"])  # every part, not just one, ended by the disconnect


@pytest.mark.parametrize("where", ["mono", "cluster"])
def test_tokenize_and_detokenize_take_vllm_and_sglang_shapes(request, where, tokenizer):
    server = request.getfixturevalue(where)
    ids, context = tokenizer.encode(PROMPTS[0]), max_model_len(server)
    one = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()
    assert (one["tokens"], one["count"], one["max_model_len"]) == (ids, len(ids), context)
    many = post(server, "/tokenize", {"prompt": PROMPTS[:2]}).json()  # SGLang's list
    assert many["tokens"] == [tokenizer.encode(p) for p in PROMPTS[:2]] and many["count"] == [
        len(x) for x in many["tokens"]
    ]
    chat = [{"role": "user", "content": "hi"}]
    want = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert post(server, "/tokenize", {"messages": chat}).json()["tokens"] == list(want["input_ids"])
    back = post(server, "/detokenize", {"tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids), "text": tokenizer.decode(ids)}
    bad = post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")
    neither = post(server, "/tokenize", {"add_special_tokens": True})
    assert (neither.status_code, neither.json()["error"]["param"]) == (400, "prompt")


@pytest.mark.parametrize("where", ["mono", "cluster"])
def test_version_and_model_info(request, where):
    server = request.getfixturevalue(where)
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == info["tokenizer_path"]
    assert info["max_model_len"] == max_model_len(server)

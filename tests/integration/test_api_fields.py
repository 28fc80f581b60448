"""What the HTTP API does with each field that changes the output, on a monolithic server: logit_bias and
min_new_tokens / min_tokens change the tokens exactly as SGLang and vLLM do, fields Tandem does not
implement are a 400 naming them (constrained decoding and tools: test_structured_output.py), and malformed values (a bad prompt of a batch, strings for integers, top_logprobs
without logprobs, logprob_start_len past the prompt) are 400s naming the field."""

from __future__ import annotations

import concurrent.futures
import copy

import httpx
import pytest
from transformers import AutoTokenizer

from tests.integration.test_structured_output import BUILTIN

EOS = 2  # SmolLM2's <|im_end|>
COMMA = 28


@pytest.fixture(scope="module")
def server(reference_servers):
    return reference_servers.get(*BUILTIN)  # the full model: its EOS, stop strings and runner-ups


@pytest.fixture(autouse=True)
def pools_idle_after(server):
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir):
    return AutoTokenizer.from_pretrained(builtin_model_dir)


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def count_ids(tokenizer) -> list[int]:
    return tokenizer.encode("1, 2, 3, 4, 5,")


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def generate(server, ids: list[int], **sampling) -> dict:
    r = post(server, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, **sampling}})
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- logit_bias ------------------------------------------------------------------------------------


def test_logit_bias_minus_100_on_the_greedy_first_token_takes_the_runner_up(server, chat_ids):
    r = post(
        server,
        "/generate",
        {
            "input_ids": chat_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )
    first, runner_up = [t for _, t, _ in r.json()["meta_info"]["output_top_logprobs"][0]]
    assert r.json()["output_ids"] == [first] == [504]
    biased = generate(server, chat_ids, max_new_tokens=1, logit_bias={str(first): -100})
    assert biased["output_ids"] == [runner_up]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_logit_bias_plus_100_makes_greedy_repeat_that_token(server, chat_ids, path):
    body = {
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {"7042": 100},
        "logprobs": 0 if "chat" not in path else True,
    }
    body |= (
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
        if "chat" in path
        else {"prompt": chat_ids}
    )
    choice = post(server, path, body).json()["choices"][0]
    lp = choice["logprobs"]
    tokens = [t["token"] for t in lp["content"]] if "chat" in path else lp["tokens"]
    assert tokens == [" Paris"] * 4
    assert choice["finish_reason"] == "length"


def test_a_biased_request_leaves_its_batch_neighbours_alone(server, chat_ids):
    want = generate(server, chat_ids, max_new_tokens=8)["output_ids"]
    alone = generate(server, chat_ids, max_new_tokens=8, logit_bias={"504": -100})["output_ids"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        biased = [pool.submit(generate, server, chat_ids, max_new_tokens=8, logit_bias={"504": -100}) for _ in range(2)]
        plain = [pool.submit(generate, server, chat_ids, max_new_tokens=8) for _ in range(2)]
        assert [f.result()["output_ids"] for f in plain] == [want, want]
        assert [f.result()["output_ids"] for f in biased] == [alone, alone]
    assert alone[0] != 504


@pytest.mark.parametrize(
    "path,bias,param",
    [
        ("/v1/completions", {"49152": 1}, "logit_bias"),  # the vocabulary is [0, 49152)
        ("/v1/completions", {"5": 101}, "logit_bias"),
        ("/v1/completions", {"five": 1}, "logit_bias"),
        ("/v1/completions", {str(i): 1 for i in range(301)}, "logit_bias"),
        ("/v1/chat/completions", {"5": "1"}, "logit_bias"),
        ("/generate", {"49152": 1}, "sampling_params.logit_bias"),
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(server, path, bias, param):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    body = (
        {"text": "hi", "sampling_params": {"logit_bias": bias}} if path == "/generate" else body | {"logit_bias": bias}
    )
    err = error_of(post(server, path, body))
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, 400)


# -- min_new_tokens --------------------------------------------------------------------------------


def test_min_new_tokens_masks_eos_until_it_is_reached(server, chat_ids):
    free = generate(server, chat_ids, max_new_tokens=40)
    assert free["output_ids"] == [504, 3575, 282, 4649, 314, 7042, 30, EOS]  # stops at EOS after 8 tokens
    got = generate(server, chat_ids, max_new_tokens=14, min_new_tokens=10)
    # the first 10 tokens are those of greedy with EOS never sampled; then greedy goes on unconstrained
    first = generate(server, chat_ids, max_new_tokens=10, logit_bias={str(EOS): -100})["output_ids"]
    rest = generate(server, chat_ids + first, max_new_tokens=4)["output_ids"]
    assert first[:7] == free["output_ids"][:7] and first[7] != EOS
    assert got["output_ids"] == first + rest
    assert got["meta_info"]["finish_reason"] == {"type": "length", "matched": None}


def test_min_new_tokens_masks_stop_token_ids_until_it_is_reached(server, count_ids):
    assert generate(server, count_ids, max_new_tokens=40, stop_token_ids=[COMMA])["output_ids"] == [216, 38, COMMA]
    got = generate(server, count_ids, max_new_tokens=12, stop_token_ids=[COMMA], min_new_tokens=5)
    first = generate(server, count_ids, max_new_tokens=5, logit_bias={str(COMMA): -100})["output_ids"]
    rest = generate(server, count_ids + first, max_new_tokens=7, stop_token_ids=[COMMA])["output_ids"]
    assert COMMA not in first
    assert got["output_ids"] == first + rest


def test_stop_strings_are_not_searched_before_min_new_tokens_and_are_after(server, count_ids):
    free = generate(server, count_ids, max_new_tokens=20)["output_ids"]  # " 6, 7, 8, 9, 10, 11, ..." digit by digit
    early = generate(server, count_ids, max_new_tokens=20, stop=["1"])
    assert early["output_ids"] == free[:14] and early["text"] == " 6, 7, 8, 9, "  # the 1 of 10 is token 14
    late = generate(server, count_ids, max_new_tokens=20, stop=["1"], min_new_tokens=15)
    assert late["output_ids"] == free[:18] and late["text"] == " 6, 7, 8, 9, 10, "  # the first 1 of 11 is token 18
    assert late["meta_info"]["finish_reason"] == {"type": "stop", "matched": "1"}
    reached = generate(server, count_ids, max_new_tokens=20, stop=["1"], min_new_tokens=14)  # token 14 counts
    assert reached["output_ids"] == free[:14]


def test_openai_min_tokens_is_min_new_tokens(server, chat_ids):
    want = generate(server, chat_ids, max_new_tokens=12, min_new_tokens=10)
    r = post(server, "/v1/completions", {"prompt": chat_ids, "max_tokens": 12, "min_tokens": 10, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == len(want["output_ids"]) == 12
    assert r.json()["choices"][0]["text"] == want["text"]
    err = error_of(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}))
    assert (err["type"], err["param"]) == ("invalid_request_error", "min_tokens")


# -- fields Tandem does not implement ------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": " end"}, "suffix"),
        ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),
        ("/generate", {"sampling_params": {"custom_params": {"a": 1}}}, "sampling_params.custom_params"),
    ],
)
def test_an_unsupported_field_that_changes_the_output_is_a_400_naming_it(server, path, extra, param):
    body = (CHAT if "chat" in path else {"text": "hi"} if path == "/generate" else COMPLETION) | extra
    err = error_of(post(server, path, body))
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert "not supported" in err["message"]


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/generate", {"lora_path": "adapter"}, "lora_path"),
        ("/v1/chat/completions", {"model": "base:adapter"}, "model"),
    ],
)
def test_an_adapter_on_a_server_without_lora_is_a_404_saying_how_to_serve_one(server, path, extra, param):
    body = (CHAT if "chat" in path else {"text": "hi"}) | extra
    err = error_of(post(server, path, body), 404)
    assert err["param"] == param
    assert "--enable-lora --lora-paths NAME=PATH" in err["message"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_priority_without_priority_scheduling_is_a_400_naming_it(server, path):
    body = (CHAT if "chat" in path else {"text": "hi"} if path == "/generate" else COMPLETION) | {"priority": 1}
    err = error_of(post(server, path, body))
    assert err["param"] == "priority" and "--enable-priority-scheduling" in err["message"]


@pytest.mark.parametrize(
    "path,extra",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {"type": "text"},
                "tools": [],
                "tool_choice": "none",
                "user": "u",
                "metadata": {"k": "v"},
                "store": False,
                "parallel_tool_calls": True,
                "service_tier": "auto",
            },
        ),
        ("/v1/chat/completions", {"tools": None, "functions": None, "response_format": None}),
        ("/v1/completions", {"best_of": 2, "n": 2, "suffix": None, "user": "u"}),
        ("/v1/completions", {"best_of": 1}),
    ],
)
def test_fields_that_change_nothing_are_accepted(server, path, extra):
    r = post(server, path, (CHAT if "chat" in path else COMPLETION) | extra | {"temperature": 0})
    assert r.status_code == 200, r.text


# -- malformed values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": ["a", 5]}, "prompt.1"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt.1"),
        ("/v1/completions", {"prompt": [[1, 2], [3, -1]]}, "prompt.1"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        (
            "/generate",
            {"text": ["a", "b"], "sampling_params": [{}, {"temperature": -1}]},
            "sampling_params.1.temperature",
        ),
        ("/generate", {"text": ["a", "b"], "rid": "one"}, "rid"),
        ("/generate", {"text": "a", "sampling_params": [{}]}, "sampling_params"),
        (
            "/generate",
            {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
    ],
)
def test_a_bad_prompt_of_a_batch_is_a_400_naming_it(server, path, body, param):
    err = error_of(post(server, path, body))
    assert (err["type"], err["param"]) == ("invalid_request_error", param)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", COMPLETION | {"max_tokens": "2"}, "max_tokens"),
        ("/v1/completions", COMPLETION | {"n": "2"}, "n"),
        ("/v1/completions", COMPLETION | {"logprobs": "1"}, "logprobs"),
        ("/v1/completions", COMPLETION | {"seed": 1.5}, "seed"),
        ("/v1/chat/completions", CHAT | {"max_completion_tokens": "2"}, "max_completion_tokens"),
        ("/v1/chat/completions", CHAT | {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "2"}}, "sampling_params.max_new_tokens"),
        ("/generate", {"text": "hi", "top_logprobs_num": "2", "return_logprob": True}, "top_logprobs_num"),
        ("/generate", {"input_ids": ["1", "2"]}, "input_ids.0"),
    ],
)
def test_integers_given_as_strings_are_a_400(server, path, body, param):
    err = error_of(post(server, path, body))
    assert (err["type"], err["param"]) == ("invalid_request_error", param)


def test_top_logprobs_without_logprobs_is_a_400_in_chat(server):
    for logprobs in (False, None):
        err = error_of(post(server, "/v1/chat/completions", CHAT | {"top_logprobs": 2, "logprobs": logprobs}))
        assert (err["type"], err["param"]) == ("invalid_request_error", "top_logprobs")
    assert post(server, "/v1/chat/completions", CHAT | {"top_logprobs": 2, "logprobs": True}).status_code == 200


def test_logprob_start_len_past_the_prompt_is_a_400_naming_it(server, count_ids):
    body = {"input_ids": count_ids, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    err = error_of(post(server, "/generate", body | {"logprob_start_len": len(count_ids)}))
    assert (err["type"], err["param"]) == ("invalid_request_error", "logprob_start_len")
    ok = post(server, "/generate", body | {"logprob_start_len": len(count_ids) - 1})
    assert [t for _, t, _ in ok.json()["meta_info"]["input_token_logprobs"]] == count_ids[-1:]


@pytest.mark.parametrize(
    "stop_ids,param", [([49152], "sampling_params.stop_token_ids"), ([-1], "sampling_params.stop_token_ids")]
)
def test_stop_token_ids_outside_the_vocabulary_are_a_400(server, stop_ids, param):
    err = error_of(
        post(server, "/generate", {"text": "hi", "sampling_params": {"stop_token_ids": stop_ids, "min_new_tokens": 1}})
    )
    assert (err["type"], err["param"]) == ("invalid_request_error", param)


# -- chat_template_kwargs --------------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(tokenizer):
    """Extra template variables (vLLM's and SGLang's chat_template_kwargs, e.g. Qwen3's enable_thinking) are
    passed to the model's chat template."""
    from common.http.chat_output import ChatShape
    from common.http.openai_api import _apply_chat_template
    from common.wire.api import ChatCompletionRequest

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% if greet %}Hello! {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = ChatCompletionRequest.model_validate({**CHAT, "chat_template_kwargs": {"greet": True}})
    shape = ChatShape(body.tool_set())
    assert _apply_chat_template(tok, body, shape) == tok.encode("Hello! " + CHAT["messages"][0]["content"])


def test_chat_template_kwargs_the_template_ignores_change_nothing(server):
    plain = post(server, "/v1/chat/completions", CHAT | {"temperature": 0})
    with_kwargs = post(
        server, "/v1/chat/completions", CHAT | {"temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert plain.status_code == with_kwargs.status_code == 200, with_kwargs.text
    assert with_kwargs.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"add_generation_prompt": False}, "enable_thinking"])
def test_chat_template_kwargs_that_the_server_sets_or_are_no_object_are_a_400(server, kwargs):
    err = error_of(post(server, "/v1/chat/completions", CHAT | {"chat_template_kwargs": kwargs}))
    assert (err["type"], err["param"]) == ("invalid_request_error", "chat_template_kwargs")


# -- what OpenAI clients send ----------------------------------------------------------------------


def test_explicit_nulls_mean_unset(server):
    """Several clients send null for every optional field they do not set: the answer is the one without them."""
    nulls = dict.fromkeys(
        ["top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stream", "user",
         "logprobs", "top_logprobs", "max_completion_tokens", "stream_options", "tools", "tool_choice",
         "parallel_tool_calls", "response_format", "model"]
    )  # fmt: skip
    body = CHAT | {"max_tokens": 8, "temperature": 0}
    want = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    got = post(server, "/v1/chat/completions", body | nulls)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want
    r = post(server, "/v1/completions", COMPLETION | {"temperature": None, "max_tokens": None, "echo": None})
    assert r.status_code == 200, r.text


def test_models_retrieve_names_the_model_or_404s(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert httpx.get(server.url + "/v1/models/" + listed["id"]).json() == listed
    r = httpx.get(server.url + "/v1/models/nope")
    assert error_of(r, 404)["param"] == "model" and "nope" in r.json()["error"]["message"]


def test_developer_role_is_the_system_role(server):
    def answer(role: str) -> dict:
        messages = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "hi"}]
        r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    dev, system = answer("developer"), answer("system")
    assert (
        dev["usage"]["prompt_tokens"] == system["usage"]["prompt_tokens"]
        and dev["choices"][0]["message"] == system["choices"][0]["message"]
    )

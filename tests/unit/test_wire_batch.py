"""Batched prompts split into one body per prompt (common/wire/batch.py), their errors renamed to the client's
fields, and their usages summed."""

from __future__ import annotations

import pytest

from common.wire.batch import MAX_PROMPTS, part_error, split_batch, summed_usage
from common.wire.errors import InvalidRequest


def test_a_completion_list_of_strings_or_id_lists_is_one_body_per_prompt():
    body = {"prompt": ["a", "b"], "max_tokens": 2}
    assert split_batch("/v1/completions", body) == [{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 2}]
    assert split_batch("/v1/completions", {"prompt": [[1, 2], [3]]}) == [{"prompt": [1, 2]}, {"prompt": [3]}]


def test_one_prompt_is_no_batch():
    assert split_batch("/v1/completions", {"prompt": [1, 2, 3]}) is None
    assert split_batch("/v1/completions", {"prompt": "a"}) is None
    assert split_batch("/generate", {"input_ids": [1, 2]}) is None
    assert split_batch("/v1/chat/completions", {"messages": []}) is None


def test_generate_spreads_per_prompt_lists_and_shares_one_value():
    body = {"text": ["a", "b"], "sampling_params": [{"temperature": 0}, {}], "rid": ["x", "y"], "stream": False}
    assert split_batch("/generate", body) == [
        {"text": "a", "sampling_params": {"temperature": 0}, "rid": "x", "stream": False},
        {"text": "b", "sampling_params": {}, "rid": "y", "stream": False},
    ]
    shared = split_batch("/generate", {"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 3}})
    assert [p["sampling_params"] for p in shared] == [{"max_new_tokens": 3}] * 2


@pytest.mark.parametrize(
    "body,param",
    [
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a", "b"], "rid": "one"}, "rid"),
        ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a"] * (MAX_PROMPTS + 1)}, "text"),
        ({"text": [], "sampling_params": {"max_new_tokens": 2}}, "text"),  # the fuzz test's find: was a 500
    ],
)
def test_a_batch_that_does_not_add_up_is_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        split_batch("/generate", body)
    assert e.value.param == param


def test_a_part_error_names_the_prompt_index():
    assert part_error("prompt has 9 tokens", "prompt", 1, ("prompt",)) == ("prompt.1 has 9 tokens", "prompt.1")
    assert part_error("sampling_params.temperature: bad", "sampling_params.temperature", 2, ("sampling_params",)) == (
        "sampling_params.2.temperature: bad",
        "sampling_params.2.temperature",
    )
    assert part_error("max_tokens: too many", "max_tokens", 0, ("prompt",)) == (
        "prompt 0: max_tokens: too many",
        "max_tokens",
    )


def test_usages_sum_field_by_field():
    a = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    b = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}
    assert summed_usage([a, b]) == {
        "prompt_tokens": 7,
        "completion_tokens": 4,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 1},
    }

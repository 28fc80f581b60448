"""Sampling parameters, the sampler and the incremental detokenizer."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from common.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from common.engine.sampler import Sampler, apply_penalties, top_p_filter
from common.engine.sampling_batch import SamplingBatch, SamplingRow
from common.wire.sampling_params import SamplingParams


def row(prompt=(), output=(), seed=None, logprobs=0, **params) -> SamplingRow:
    return SamplingRow(
        SamplingParams(seed=seed, **params),
        list(prompt),
        list(output),
        top_logprobs_num=logprobs,
        return_logprob=logprobs > 0,
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    return Sampler().sample(logits, SamplingBatch(rows, logits.shape[-1], "cpu"))


def penalize(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    return apply_penalties(logits[None], SamplingBatch([r], logits.shape[-1], "cpu"))[0]


@pytest.mark.parametrize(
    "params,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"n": 0}, "n"),
        ({"top_k": 0}, "top_k"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"unknown": 1}, "unknown"),
        ({"max_new_tokens": "2"}, "max_new_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"seed": 1.0}, "seed"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"1": True}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(params, field):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**params)
    assert e.value.errors()[0]["loc"][0] == field


def test_logit_bias_keys_become_token_ids():
    assert SamplingParams(logit_bias={"7": -100, "300": 2.5}).logit_bias == {7: -100.0, 300: 2.5}


def test_greedy_and_top_k_1_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 1.9], [3.0, -1.0, 0.0]])
    out = sample(logits, [row(temperature=0), row(temperature=1.0, top_k=1, seed=3)])
    assert out.token_ids == [1, 0]


def test_seeded_sampling_is_reproducible_whatever_the_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], [row(temperature=1.0, seed=42)]).token_ids[0]
    batched = sample(logits, [row(temperature=1.0, seed=1), row(temperature=1.0, seed=42), row(temperature=0.7)])
    assert batched.token_ids[1] == alone


def test_tiny_top_p_keeps_only_the_best_token():
    probs = torch.tensor([0.1, 0.6, 0.3])
    assert top_p_filter(probs, 0.01).tolist() == [0.0, pytest.approx(0.6), 0.0]
    assert top_p_filter(probs, 0.7).tolist() == [0.0, pytest.approx(0.6), pytest.approx(0.3)]
    assert top_p_filter(probs, 1e-136).tolist() == [
        0.0,
        pytest.approx(0.6),
        0.0,
    ]  # below float32's range (found by fuzzing)


def test_min_p_never_samples_a_token_below_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.45, 0.05]]))
    ids = {sample(logits, [row(temperature=1.0, min_p=0.2, seed=s)]).token_ids[0] for s in range(40)}
    assert ids == {0, 1}


def test_penalties_follow_hf_and_openai_formulas():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = penalize(logits, row(prompt=[0], output=[1], repetition_penalty=2.0))
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    freq = penalize(logits, row(output=[2, 2, 3], frequency_penalty=0.5, presence_penalty=0.25))
    assert freq.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]


def test_logprobs_are_raw_log_softmax_with_sorted_top_entries():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sample(logits, [row(temperature=0, logprobs=2)])
    expected = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(float(expected[1]))
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2]
    assert out.top_logprobs[0][1][1] == pytest.approx(float(expected[2]))


# -- detokenizer -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_model_dir)


@pytest.mark.parametrize(
    "text", ["Héllo wörld, ça va? 🎉🚀 done", "日本語のテキストと中文", "plain ascii text", "emoji 👩‍👩‍👧 family"]
)
def test_incremental_decoding_equals_full_decoding_and_never_emits_half_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_split_across_deltas_is_found_and_trimmed():
    m = StopStringMatcher(["STOP", "END"])
    assert m.feed("hello ST") == ("hello ", None)  # "ST" may start STOP: held back
    assert m.feed("OP and more") == ("", "STOP")


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a S") == ("a ", None)
    assert m.feed("ure") == ("Sure", None)
    assert m.feed("...S") == ("...", None)
    assert m.flush() == "S"


def test_text_passed_through_is_never_searched_and_releases_what_was_held():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", None)
    assert m.pass_through("OP b") == ("STOP b")
    assert m.feed(" STOP") == (" ", "STOP")


def test_earliest_of_several_stops_wins_and_can_be_kept():
    m = StopStringMatcher(["b", "a"], include_stop=True)
    assert m.feed("xxab") == ("xxa", "a")

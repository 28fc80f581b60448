"""Speculative decoding in one engine (in process): NGRAM and STANDALONE (a 4-layer tiny Llama whose last two
layers are quiet, drafted by its first two) give the tokens and logprobs of decoding without speculation,
greedy and seeded-sampled, with penalties, min_tokens, logit bias and stop tokens; a stop inside an accepted
chain ends the request there; retraction under a small pool resumes exactly; only committed tokens' KV
enters the prefix cache, and a next turn that reuses it decodes the same; every pool is idle afterwards.
Sampled acceptance without a seed is lossless in distribution: on an 8-token vocabulary the first two tokens'
joint frequencies match the target's probabilities (chi-square).
NEXTN (a tiny DeepSeek-V3 with an MTP layer), EAGLE and EAGLE3 (tiny Llamas and a head of one layer in its own
directory; EAGLE3's own parts: test_speculative_eagle3.py), prompts in chunks: greedy and seeded tokens and logprobs equal decoding without them, with drafts
accepted; retraction and a next turn over the prefix cache resume exactly. The EAGLE loader takes names with
or without `model.`, and a head whose KV does not fit the target's pages is refused at start-up naming both
shapes."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.model.eagle import eagle_config, load_eagle_head
from common.model.loader import load_hf_config, load_model
from common.model.truncate import truncate_model
from common.wire.sampling_params import SamplingParams
from common.wire.user_error import UserError
from tests.integration.spec_models import (
    save_deepseek_mtp,
    save_eagle3_target_and_head,
    save_eagle_target_and_head,
    save_llama,
    save_target_and_draft,
)
from tests.integration.tiny_model import random_prompts

PAGE = 4
NEW = 24


def repetitive_prompts() -> list[list[int]]:
    """Random prompts and prompts that repeat a phrase (NGRAM drafts from those)."""
    phrases = random_prompts(2, 6, 12, seed=5)
    return random_prompts(2, 5, 60, seed=4) + [p * 5 for p in phrases]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_target_and_draft(tmp_path_factory.mktemp("spec"))


def engine(model, **flags) -> Engine:
    return Engine(ServerConfig(model=str(model), page_size=PAGE, max_total_tokens=flags.pop("tokens", 4096), **flags))


SPEC = {
    "off": {},
    "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5},
    "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3},
}


@pytest.fixture(scope="module")
def engines(models):
    target, draft = models
    return {
        name: engine(target, **flags, **({"speculative_draft_model_path": str(draft)} if name == "STANDALONE" else {}))
        for name, flags in SPEC.items()
    }


def run(e: Engine, prompts: list[list[int]], per_request: list[dict] | None = None, **params) -> list[Req]:
    """Every prompt to completion in one batch, with `params` (and `per_request[i]` for prompt i)."""
    logprobs = params.pop("logprobs", False)
    per_request = per_request or [{}] * len(prompts)
    base = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True} | params
    reqs = [Req(f"r{i}", p, SamplingParams(**base | own)) for i, (p, own) in enumerate(zip(prompts, per_request))]
    for r in reqs:
        r.return_logprob, r.top_logprobs_num = logprobs, 3 if logprobs else 0
        e.scheduler.add_request(r)
    while e.scheduler.step():
        pass
    counts = e.scheduler.check_integrity()
    assert counts.owned == counts.locked == 0
    assert all(r.finish is not None and r.finish.type != "abort" for r in reqs), [r.finish for r in reqs]
    return reqs


def assert_same(base: list[Req], spec: list[Req]) -> None:
    for a, b in zip(base, spec):
        assert b.output_ids == a.output_ids, f"{a.rid} diverged"
        assert b.finish.type == a.finish.type
        if a.output_logprobs and a.output_logprobs[0] is not None:
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
            assert [[t for t, _ in top] for top in a.output_top_logprobs] == [
                [t for t, _ in top] for top in b.output_top_logprobs
            ]


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_greedy_tokens_and_logprobs_equal_decoding_without_speculation(engines, algo):
    prompts = repetitive_prompts()
    base, spec = run(engines["off"], prompts, logprobs=True), run(engines[algo], prompts, logprobs=True)
    assert_same(base, spec)
    assert all(r.spec_verify_ct > 0 for r in spec)
    assert sum(r.spec_accepted for r in spec) > (30 if algo == "STANDALONE" else 0)  # NGRAM: few on a random model
    assert all(r.spec_verify_ct == 0 for r in base)


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_seeded_sampling_penalties_min_tokens_and_bias_equal_decoding_without_speculation(engines, algo):
    cases = [
        {"temperature": 0.8, "top_p": 0.9, "seed": 7},
        {"temperature": 1.0, "top_k": 20, "seed": 11, "repetition_penalty": 1.3, "frequency_penalty": 0.2},
        {"ignore_eos": False, "min_new_tokens": 12, "stop_token_ids": [3, 5, 7, 9], "logit_bias": {"7": 5.0}},
    ]
    prompts = [p for p in repetitive_prompts()[1:] for _ in cases]
    per_request = cases * (len(prompts) // len(cases))
    base, spec = run(engines["off"], prompts, per_request), run(engines[algo], prompts, per_request)
    assert_same(base, spec)


def test_a_stop_inside_an_accepted_chain_ends_the_request_there(engines):
    prompts = repetitive_prompts()
    stops = [{"stop_token_ids": [r.output_ids[9]]} for r in run(engines["off"], prompts)]  # each answer's 10th token
    base, spec = run(engines["off"], prompts, stops), run(engines["STANDALONE"], prompts, stops)
    assert_same(base, spec)
    assert all(len(r.output_ids) <= 10 and r.output_ids[-1] == s["stop_token_ids"][0] for r, s in zip(spec, stops))
    assert sum(r.spec_accepted for r in spec) > 0


def cached_paths(e: Engine) -> list[list[int]]:
    cache = e.memory.prefix_cache
    return [[t for n in node.path() for t in n.key] for node in cache._nodes() if not node.children]


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_only_committed_tokens_enter_the_prefix_cache_and_a_next_turn_reuses_them(models, algo):
    target, draft = models
    extra = {"speculative_draft_model_path": str(draft)} if algo == "STANDALONE" else {}
    spec, base = engine(target, **SPEC[algo], **extra), engine(target)
    prompts = repetitive_prompts()[1:3]
    first = run(spec, prompts)
    sequences = [r.prompt_ids + r.output_ids for r in first]
    for path in cached_paths(spec):
        assert any(seq[: len(path)] == path for seq in sequences), "a cached page holds tokens no request committed"
    turns = [seq + p[:7] for seq, p in zip(sequences, random_prompts(len(sequences), 7, 7, seed=9))]
    again, want = run(spec, turns), run(base, turns)
    assert_same(want, again)
    assert all(r.prefix_hit_len >= len(seq) - 1 - PAGE for r, seq in zip(again, sequences))


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_retraction_under_a_small_pool_resumes_exactly(models, engines, algo):
    target, draft = models
    extra = {"speculative_draft_model_path": str(draft)} if algo == "STANDALONE" else {}
    small = engine(target, tokens=256, max_running_requests=8, **SPEC[algo], **extra)
    prompts = repetitive_prompts()
    want = run(engines["off"], prompts, max_new_tokens=48)
    got = run(small, prompts, max_new_tokens=48)
    assert_same(want, got)
    assert small.scheduler.decode.num_retractions > 0


def chi_square_quantile(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the normal quantile z (3.09: 0.999), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_sampled_acceptance_without_a_seed_keeps_the_target_distribution(tmp_path, algo):
    """Three tokens per request, unseeded at temperature 1: the first from the prefill, the second from a verify
    of one draft (kept or rejected), the third the bonus token after a kept draft or the next step's. The
    joint frequencies of the second and third match the target's probabilities, summed over the first."""
    vocab, n = 8, 1500
    target = save_llama(tmp_path / "t", vocab=vocab, layers=2, quiet_from=1, tail_scale=0.5)
    extra = {}
    if algo == "STANDALONE":
        extra = {"speculative_draft_model_path": str(truncate_model(str(target), 1, tmp_path / "d"))}
    e = engine(target, max_running_requests=256, **SPEC[algo], **extra)
    prompt = list(range(vocab)) * 2  # NGRAM drafts t + 1 after any t
    reqs = run(e, [prompt] * n, max_new_tokens=3, temperature=1.0)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = hf(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1].softmax(-1)  # [t1, t2]
        seqs = [prompt + [a, b] for a in range(vocab) for b in range(vocab)]
        p3 = hf(torch.tensor(seqs)).logits[:, -1].softmax(-1).view(vocab, vocab, vocab)  # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten()  # [t2, t3]
    counts = torch.zeros(vocab * vocab)
    for r in reqs:
        counts[r.output_ids[1] * vocab + r.output_ids[2]] += 1
    expected = joint * n
    keep = expected >= 5  # cells too rare for the test are pooled into one
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_quantile(len(observed) - 1), chi2
    accepted, verified = sum(r.spec_accepted for r in reqs), sum(r.spec_verify_ct for r in reqs)
    assert 0.05 * verified < accepted < 0.95 * verified  # drafts both kept and rejected


@pytest.fixture(scope="module")
def eagle_models(tmp_path_factory):
    """The EAGLE test target and its head."""
    return save_eagle_target_and_head(tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module", params=["NEXTN", "EAGLE", "EAGLE3"])
def head_model(request, tmp_path_factory) -> tuple[str, dict]:
    """A target with a draft head and the flags that draft with it: NEXTN's MTP layer, an EAGLE or EAGLE3 head."""
    flags = {"speculative_algorithm": request.param, "speculative_num_steps": 3}
    if request.param == "NEXTN":
        return save_deepseek_mtp(tmp_path_factory.mktemp("mtp")), flags
    if request.param == "EAGLE3":
        target, head = save_eagle3_target_and_head(tmp_path_factory.mktemp("eagle3"))
    else:
        target, head = request.getfixturevalue("eagle_models")
    return target, flags | {"speculative_draft_model_path": str(head)}


def test_a_head_greedy_seeded_and_a_next_turn_equal_decoding_without_it(head_model):
    """Prompts in chunks of 16: the head runs each chunk's pairs, the last one waits for the sampled token;
    a next turn hits the prefix cache (less its last page: the head's KV there depends on the next token)."""
    model, flags = head_model
    off, spec_engine = (engine(model, chunked_prefill_size=16, **f) for f in ({}, flags))
    prompts = repetitive_prompts()[1:3]
    cases = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}]
    per_request = [c for c in cases for _ in prompts]
    base = run(off, prompts * 2, per_request, logprobs=True, max_new_tokens=16)
    spec = run(spec_engine, prompts * 2, per_request, logprobs=True, max_new_tokens=16)
    assert_same(base, spec)
    assert all(r.spec_verify_ct > 0 for r in spec)
    assert sum(r.spec_accepted for r in spec) > 10  # the heads pass the token's embedding on: they guess well
    turns = [r.prompt_ids + r.output_ids + p for r, p in zip(spec, random_prompts(2, 5, 5, seed=9))]
    want, again = run(off, turns, max_new_tokens=16), run(spec_engine, turns, max_new_tokens=16)
    assert_same(want, again)
    assert all(r.prefix_hit_len > 0 for r in again) and sum(r.spec_accepted for r in again) > 0


def test_a_head_retraction_under_a_small_pool_resumes_exactly(head_model):
    model, flags = head_model
    small = engine(model, tokens=192, max_running_requests=8, **flags)
    prompts = repetitive_prompts()
    want, got = run(engine(model), prompts, max_new_tokens=40), run(small, prompts, max_new_tokens=40)
    assert_same(want, got)
    assert small.scheduler.decode.num_retractions > 0


def test_eagle_head_loads_with_or_without_the_model_prefix(eagle_models, tmp_path):
    target, head = eagle_models
    tensors = load_file(head / "model.safetensors")
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    save_file({f"model.{k}": v for k, v in tensors.items()}, prefixed / "model.safetensors")
    (prefixed / "config.json").write_text((head / "config.json").read_text())
    hf = load_hf_config(target)
    model = load_model(target, hf, torch.float32, "cpu")
    plain, other = (
        dict(load_eagle_head(eagle_config(str(d), hf), model, torch.float32, "cpu").named_parameters())
        for d in (head, prefixed)
    )
    assert plain.keys() == other.keys() and all(torch.equal(plain[n], other[n]) for n in plain)
    assert torch.equal(plain["fc.weight"], tensors["fc.weight"])
    assert torch.equal(plain["decoder.mlp.down_proj.weight"], tensors["layers.0.mlp.down_proj.weight"])


def test_an_eagle_head_of_another_kv_shape_is_refused_at_start_up_naming_both(eagle_models):
    target, _ = eagle_models
    _, head = save_eagle_target_and_head(target.parent, kv_heads=4)
    with pytest.raises(UserError) as refused:
        engine(target, speculative_algorithm="EAGLE", speculative_draft_model_path=str(head))
    assert str(refused.value) == (
        f"--speculative-draft-model-path {head}: the EAGLE head's (attention, hidden size, query heads, KV heads, "
        "head dim, vocabulary) is ('mha', 64, 4, 4, 16, 512), the target's ('mha', 64, 4, 2, 16, 512); it reads "
        "the target's hidden states and keeps its KV as one more layer of the target's pages, so they must match: "
        "give the head trained for this target"
    )

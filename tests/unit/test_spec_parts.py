"""Speculative decoding's pieces without a model: NGRAM's proposals, acceptance from sampled positions, the
flags' refusals, the KV layout's `speculative` field, NEXTN's aux record carrying a hidden state, the names
an EAGLE and an EAGLE3 checkpoint give their head's weights, and the target layers an EAGLE3 head reads."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import PretrainedConfig

from common.config import ServerConfig
from common.engine.sampler import SampleOutput
from common.engine.spec.ngram import NgramIndex
from common.engine.spec.verify import accept
from common.model.draft import draft_config
from common.model.eagle import eagle_config, head_param_name
from common.model.eagle3 import capture_layers, eagle3_param_name
from common.wire.kv_layout import LAYOUT_KEYS, layout_mismatch
from common.wire.user_error import UserError
from transfer.aux_record import AuxRecord, record_bytes


def propose(tokens: list[int], k: int, windows=range(1, 4)) -> list[int]:
    return NgramIndex(windows).propose(tokens, k)


def test_ngram_drafts_what_followed_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # the latest "1 2 3" was followed by 7 5
    assert propose([4, 1, 2, 8, 3, 2], 3) == [8, 3, 2]  # "2" alone matches
    assert propose([5, 6, 7], 3) == []  # nothing occurred before
    assert propose([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # a period shorter than k repeats


def test_ngram_index_grows_with_the_tokens():
    index, tokens = NgramIndex(range(1, 3)), [1, 2, 3]
    assert index.propose(tokens, 2) == []
    tokens += [4, 1, 2]
    assert index.propose(tokens, 2) == [3, 4]
    assert index.indexed == len(tokens) - 1


def test_acceptance_keeps_drafts_up_to_the_first_mismatch_then_the_targets_token():
    # two requests: drafts [5, 6, 7] (target picks 5, 6, 9, 4) and [3] (target picks 8, 1)
    out = SampleOutput(None, [5, 6, 9, 4, 8, 1], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], [None] * 6)
    first, second = accept(out, [[5, 6, 7], [3]])
    assert (first.tokens, first.accepted, first.drafted, first.logprobs) == ([5, 6, 9], 2, 3, [-0.1, -0.2, -0.3])
    assert (second.tokens, second.accepted, second.logprobs) == ([8], 0, [-0.5])
    [full] = accept(SampleOutput(None, [1, 2, 3], [None] * 3, [None] * 3), [[1, 2]])
    assert full.tokens == [1, 2, 3] and full.accepted == 2  # every draft kept, and the bonus token


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"speculative_algorithm": "EAGLE"}, "EAGLE needs --speculative-draft-model-path"),
        ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/x", "tp_size": 2}, "EAGLE runs its"),
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "tree verification"),
        ({"speculative_algorithm": "STANDALONE"}, "STANDALONE needs --speculative-draft-model-path"),
        (
            {"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/x"},
            "for STANDALONE, EAGLE and EAGLE3 only, not NGRAM",
        ),
        ({"speculative_draft_model_path": "/x"}, "needs --speculative-algorithm STANDALONE, EAGLE or EAGLE3"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_num_draft_tokens": 6}, "give 4"),
        ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/x", "tp_size": 2}, "--tp-size 1"),
        ({"speculative_algorithm": "NEXTN", "tp_size": 2}, "NEXTN runs its draft on one rank"),
        ({"speculative_algorithm": "NEXTN", "tp_size": 2, "enable_dp_attention": True}, "dp-attention"),
        ({"speculative_algorithm": "EAGLE3"}, "EAGLE3 needs --speculative-draft-model-path"),
        ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/x", "tp_size": 2}, "EAGLE3 runs its"),
        ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/x", "enable_dp_attention": True}, "dp"),
    ],
)
def test_flags_that_do_not_fit_are_refused_naming_them(flags, words):
    with pytest.raises(ValidationError, match=words):
        ServerConfig(**flags)


def test_drafts_per_verify_follow_sglangs_flags():
    assert ServerConfig().speculative_draft_len == 0
    assert ServerConfig(speculative_algorithm="NGRAM").speculative_draft_len == 3
    assert ServerConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8).speculative_draft_len == 7
    assert ServerConfig(speculative_algorithm="NGRAM", speculative_num_steps=5).speculative_draft_len == 5


def layout(speculative: str | None) -> dict:
    base = {k: 1 for k in LAYOUT_KEYS}
    return base | {"speculative": speculative} if speculative is not None else base


def test_layouts_pair_only_with_the_same_draft_state():
    draft = "STANDALONE draft=abc layers=2"
    assert layout_mismatch(layout("NGRAM"), layout("none")) is None  # NGRAM keeps no state beyond the tokens
    assert layout_mismatch(layout("none"), {k: 1 for k in LAYOUT_KEYS if k != "speculative"}) is None  # older prefill
    assert layout_mismatch(layout(draft), layout(draft)) is None
    message = layout_mismatch(layout("none"), layout(draft))
    assert f"speculative: decode has 'none', prefill has '{draft}'" in message
    assert "speculative: decode has 'NGRAM'" in layout_mismatch(layout("NGRAM"), layout(draft))
    nextn = "NEXTN mtp=abc layers=1 hidden=64xfloat32"
    assert "speculative: decode has 'none', prefill has 'NEXTN mtp=abc" in layout_mismatch(
        layout("none"), layout(nextn)
    )
    eagle = "EAGLE head=def layers=1 hidden=64xfloat32"
    assert f"speculative: decode has '{eagle}', prefill has '{nextn}'" in layout_mismatch(layout(eagle), layout(nextn))


def test_nextn_aux_record_carries_the_hidden_state_and_is_sized_by_it():
    hidden = bytes(range(256))
    raw = AuxRecord(7, 42, 4, 30, -0.5, [(42, -0.5)], hidden).pack()
    assert len(raw) == record_bytes(256) == record_bytes() + 256
    rec = AuxRecord.unpack(raw, 256)
    assert (rec.first_token, rec.top_logprobs, rec.hidden) == (42, [(42, -0.5)], hidden)
    assert AuxRecord.unpack(AuxRecord(7, 42, 4, 30).pack()).hidden == b""
    with pytest.raises(ValueError, match="expected"):
        AuxRecord.unpack(raw)  # a decode expecting no hidden state


def test_eagle_checkpoint_names_map_to_the_heads_parameters_with_or_without_the_model_prefix():
    for prefix in ("", "model."):
        assert head_param_name(prefix + "fc.weight") == "fc.weight"
        assert head_param_name(prefix + "fc.bias") == "fc.bias"
        assert head_param_name(prefix + "embed_tokens.weight") == "embed_tokens.weight"
        assert head_param_name(prefix + "layers.0.self_attn.q_proj.weight") == "decoder.self_attn.q_proj.weight"
        assert head_param_name(prefix + "layers.0.mlp.down_proj.weight") == "decoder.mlp.down_proj.weight"
        assert head_param_name(prefix + "layers.0.post_attention_layernorm.weight") == (
            "decoder.post_attention_layernorm.weight"
        )
        assert head_param_name(prefix + "layers.0.input_layernorm.weight") is None  # EAGLE skips layer 0's
    assert head_param_name("lm_head.weight") == "lm_head.weight"
    assert head_param_name("layers.1.mlp.up_proj.weight") == "layers.1.mlp.up_proj.weight"  # no parameter: refused


def test_eagle3_checkpoint_names_map_to_the_heads_parameters_with_or_without_the_model_prefix():
    for prefix in ("", "model."):
        assert eagle3_param_name(prefix + "fc.weight") == "fc.weight"
        assert eagle3_param_name(prefix + "midlayer.self_attn.q_proj.weight") == "midlayer.self_attn.q_proj.weight"
        assert eagle3_param_name(prefix + "midlayer.hidden_norm.weight") == "midlayer.hidden_norm.weight"
        assert eagle3_param_name(prefix + "norm.weight") == "norm.weight"
        for unused in ("d2t", "t2d", "embed_tokens.weight"):  # d2t is read apart; the target's embedding is used
            assert eagle3_param_name(prefix + unused) is None
    assert eagle3_param_name("lm_head.weight") == "lm_head.weight"


def test_a_draft_path_that_is_not_there_is_refused_naming_its_flag():
    for check in (draft_config, eagle_config):
        with pytest.raises(UserError) as refused:
            check("/nonexistent/head", PretrainedConfig())
        assert str(refused.value).startswith("--speculative-draft-model-path /nonexistent/head: not found; give a")


def test_eagle3_reads_the_layers_sglang_picks():
    """[2, L // 2, L - 3] of the target's L layers, or one past each configured id (that layer's output)."""
    assert capture_layers(PretrainedConfig(), 32) == (2, 16, 29)
    assert capture_layers(PretrainedConfig(), 7) == (2, 3, 4)
    ids = {"eagle_aux_hidden_state_layer_ids": [30, 1, 15]}
    assert capture_layers(PretrainedConfig(eagle_config=ids), 32) == (2, 16, 31)  # in layer order

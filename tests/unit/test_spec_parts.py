"""Speculative decoding's pieces without a model: NGRAM's proposals, acceptance from sampled positions, the
flags' refusals, the KV layout's `speculative` field, and NEXTN's aux record carrying a hidden state."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.config import ServerConfig
from common.engine.sampler import SampleOutput
from common.engine.spec.ngram import NgramIndex
from common.engine.spec.verify import accept
from common.wire.kv_layout import LAYOUT_KEYS, layout_mismatch
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
        ({"speculative_algorithm": "EAGLE"}, "EAGLE is not implemented"),
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "tree verification"),
        ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
        ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/x"}, "only it takes one"),
        ({"speculative_draft_model_path": "/x"}, "needs --speculative-algorithm STANDALONE"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_num_draft_tokens": 6}, "give 4"),
        ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/x", "tp_size": 2}, "--tp-size 1"),
        ({"speculative_algorithm": "NEXTN", "tp_size": 2}, "NEXTN runs its draft on one rank"),
        ({"speculative_algorithm": "NEXTN", "tp_size": 2, "enable_dp_attention": True}, "dp-attention"),
        ({"speculative_algorithm": "EAGLE3"}, "EAGLE3 is not implemented"),
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


def test_nextn_aux_record_carries_the_hidden_state_and_is_sized_by_it():
    hidden = bytes(range(256))
    raw = AuxRecord(7, 42, 4, 30, -0.5, [(42, -0.5)], hidden).pack()
    assert len(raw) == record_bytes(256) == record_bytes() + 256
    rec = AuxRecord.unpack(raw, 256)
    assert (rec.first_token, rec.top_logprobs, rec.hidden) == (42, [(42, -0.5)], hidden)
    assert AuxRecord.unpack(AuxRecord(7, 42, 4, 30).pack()).hidden == b""
    with pytest.raises(ValueError, match="expected"):
        AuxRecord.unpack(raw)  # a decode expecting no hidden state

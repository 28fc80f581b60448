"""EAGLE3's head and what the target gives it, in one engine (in process; its greedy and seeded decoding, next
turns and retraction run with NEXTN's and EAGLE's in test_speculative.py): the target keeps the residual
stream at the input of the head's three layers, as transformers' hidden_states give them, and that is the
prompt's aux record across PD, named by the KV layout's `speculative` field (an EAGLE peer is refused naming
both); the loader takes SGLang's names with or without `model.` and maps draft ids through d2t; a head whose
attention does not fit the target's pages, whose layers the target lacks, or whose smaller draft vocabulary
has no d2t, is refused at start-up in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.model.eagle3 import eagle3_config, load_eagle3_head
from common.model.identity import model_identity
from common.model.loader import load_hf_config, load_model
from common.wire.kv_layout import LAYOUT_KEYS, layout_mismatch
from common.wire.sampling_params import SamplingParams
from common.wire.user_error import UserError
from tests.integration.spec_models import DRAFT_VOCAB, save_eagle3_target_and_head
from tests.integration.tiny_model import random_prompts


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    return save_eagle3_target_and_head(tmp_path_factory.mktemp("eagle3"))


def eagle3_engine(target, head) -> Engine:
    flags = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head)}
    return Engine(ServerConfig(model=str(target), page_size=4, chunked_prefill_size=16, **flags))


def test_the_aux_hidden_state_is_the_inputs_of_three_layers_as_transformers_gives_them(eagle3):
    """A prompt of 37 tokens in chunks of 16 and one new token: the head's pending hidden state (what the aux
    record carries across PD) is transformers' hidden_states[1], [2] and [3] at the prompt's last position."""
    target, head = eagle3
    e = eagle3_engine(target, head)
    prompt = random_prompts(1, 37, 37, seed=41)[0]
    req = Req("r0", prompt, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
    e.scheduler.add_request(req)
    while e.scheduler.step():
        pass
    got = torch.frombuffer(bytearray(e.parts.schedulers.drafter.pending_bytes(req)), dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0, -1] for i in (1, 2, 3)])
    assert got.shape == (3 * 64,) and e.parts.schedulers.drafter.hidden_bytes == 3 * 64 * 4
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert e.parts.schedulers.speculative == f"EAGLE3 head={model_identity(head)} layers=1 hidden=192xfloat32"
    eagle = f"EAGLE head={model_identity(head)} layers=1 hidden=64xfloat32"
    layouts = [{k: 1 for k in LAYOUT_KEYS} | {"speculative": s} for s in (eagle, e.parts.schedulers.speculative)]
    assert f"speculative: decode has '{eagle}', prefill has '{e.parts.schedulers.speculative}'" in layout_mismatch(
        *layouts
    )


def test_the_loader_takes_sglangs_names_with_or_without_model_and_maps_draft_ids_through_d2t(eagle3, tmp_path):
    target, head = eagle3
    tensors = load_file(head / "model.safetensors")
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    extra = {"model.embed_tokens.weight": torch.zeros(512, 64)}  # read past: the target's embedding is used
    save_file({f"model.{k}": v for k, v in tensors.items()} | extra, prefixed / "model.safetensors")
    shutil.copy(head / "config.json", prefixed / "config.json")
    hf = load_hf_config(target)
    model = load_model(target, hf, torch.float32, "cpu")
    plain, other = (load_eagle3_head(eagle3_config(str(d), hf), model, torch.float32, "cpu") for d in (head, prefixed))
    params = dict(plain.named_parameters())
    assert params.keys() == dict(other.named_parameters()).keys()
    assert all(torch.equal(p, dict(other.named_parameters())[n]) for n, p in params.items())
    assert torch.equal(params["midlayer.self_attn.q_proj.weight"], tensors["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(params["midlayer.hidden_norm.weight"], tensors["midlayer.hidden_norm.weight"])
    assert plain.capture == (1, 2, 3) and plain.hidden_in == 192
    assert plain.lm_head.weight.shape == (DRAFT_VOCAB, 64) and torch.equal(plain.d2t, other.d2t)
    out = torch.randn(5, 64)
    draft_ids = plain.lm_head(plain.norm(out)).argmax(-1)
    assert torch.equal(plain.draft_tokens(model, out), draft_ids + tensors["d2t"][draft_ids])


def refusal(target, head) -> str:
    with pytest.raises(UserError) as refused:
        eagle3_engine(target, head)
    return str(refused.value)


def test_a_head_that_does_not_fit_the_target_is_refused_at_start_up_in_one_line(eagle3):
    target, head = eagle3
    _, other_kv = save_eagle3_target_and_head(head.parent, kv_heads=2)
    assert refusal(target, other_kv) == (
        f"--speculative-draft-model-path {other_kv}: the EAGLE3 head's (attention, hidden size, query heads, KV "
        "heads, head dim, vocabulary) is ('mha', 64, 4, 2, 16, 512), the target's ('mha', 64, 4, 4, 16, 512); it "
        "reads the target's hidden states and keeps its KV as one more layer of the target's pages, so they must "
        "match: give the head trained for this target"
    )
    _, no_d2t = save_eagle3_target_and_head(head.parent, d2t=False)
    assert refusal(target, no_d2t) == (
        f"--speculative-draft-model-path {no_d2t}: the EAGLE3 head's draft vocabulary ({DRAFT_VOCAB}) is not the "
        "target's (512) and it has no d2t tensor mapping draft ids to target ids"
    )
    deep = head.parent / "eagle3-head-deep"
    shutil.copytree(head, deep)
    config = json.loads((deep / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 4]
    (deep / "config.json").write_text(json.dumps(config))
    assert refusal(target, deep) == (
        f"--speculative-draft-model-path {deep}: the EAGLE3 head reads the inputs of the target's layers [1, 2, 5], "
        "not three of its 4 layers: give eagle_config.eagle_aux_hidden_state_layer_ids (three of 0..2) in its config"
    )

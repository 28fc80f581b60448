"""Models for the speculative decoding tests: a tiny Llama whose last layers barely change the residual
stream, so its first layers plus its head (a STANDALONE draft cut by common/model/truncate.py) agree with it
often but not always; a Llama of 8 tokens for the statistical test of sampled acceptance; a tiny DeepSeek-V3
with an MTP layer (NEXTN); tiny Llamas with an EAGLE head and with an EAGLE3 head."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common.model.truncate import truncate_model


def save_llama(
    path: Path, vocab: int, layers: int, quiet_from: int | None = None, tail_scale: float = 0.1, kv_heads: int = 2
) -> Path:
    """A random Llama; layers from `quiet_from` on have their output projections scaled by `tail_scale`."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[quiet_from if quiet_from is not None else layers :]:
            layer.self_attn.o_proj.weight.mul_(tail_scale)
            layer.mlp.down_proj.weight.mul_(tail_scale)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{vocab - 1}").save_pretrained(path)
    return path


def save_target_and_draft(root: Path) -> tuple[Path, Path]:
    """A 4-layer target whose last two layers are quiet, and its first two layers as the draft."""
    target = save_llama(root / "target", vocab=512, layers=4, quiet_from=2)
    return target, truncate_model(str(target), 2, root / "draft")


def save_deepseek_mtp(path: Path, quiet: float = 0.01) -> Path:
    """A tiny DeepSeek-V3 (tests/integration/moe_models.py) whose layers barely change the residual stream, and
    an MTP layer (`model.layers.3`, config num_nextn_predict_layers 1) in a shard of its own, as DeepSeek ships
    it: eh_proj passes the next token's embedding through, so it guesses what the target would (a real
    acceptance rate, not only rejections), and its random decoder layer is quiet too."""
    import copy
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.integration.moe_models import save_family

    save_family(path, "deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config, n, h = model.config, model.config.num_hidden_layers, model.config.hidden_size
    torch.manual_seed(1)
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = n + 1
    layer = AutoModelForCausalLM.from_config(deeper).model.layers[n]  # initialised as transformers does
    with torch.no_grad():
        for block in [*model.model.layers, layer]:
            for name, p in block.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                    p.mul_(quiet)
    model.save_pretrained(path)
    eh = torch.cat((torch.eye(h), torch.randn(h, h) * 0.02), dim=1)
    state = layer.state_dict()
    gate_up, down = state.pop("mlp.experts.gate_up_proj"), state.pop("mlp.experts.down_proj")  # [E, 2I, H], [E, H, I]
    for e in range(len(gate_up)):  # the checkpoint's names: one tensor per expert
        gate, up = gate_up[e].chunk(2)
        state |= {f"mlp.experts.{e}.gate_proj.weight": gate, f"mlp.experts.{e}.up_proj.weight": up}
        state[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    tensors = {f"model.layers.{n}.{k}": v for k, v in state.items()}
    tensors |= {
        f"model.layers.{n}.enorm.weight": torch.ones(h),
        f"model.layers.{n}.hnorm.weight": torch.ones(h),
        f"model.layers.{n}.eh_proj.weight": eh,
        f"model.layers.{n}.shared_head.norm.weight": model.model.norm.weight.detach().clone(),
        f"model.layers.{n}.shared_head.head.weight": model.lm_head.weight.detach().clone(),
        f"model.layers.{n}.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "mtp.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}, indent=2))
    return path


def save_eagle_target_and_head(root: Path, kv_heads: int | None = None) -> tuple[Path, Path]:
    """A 2-layer Llama whose layers barely change the residual stream (it guesses the next token from the last
    one, as the NEXTN test model does) and an EAGLE head for it (SGLang's LlamaForCausalLMEagle layout, names
    without `model.`): fc passes the next token's embedding through plus a little of the hidden state, and
    its decoder layer is the target's last, so it guesses what the target would, often but not always.
    `kv_heads`: the head gets another KV head count, so its KV does not fit the target's pages."""
    import json

    from safetensors.torch import save_file

    target = root / "target"
    if not target.exists():
        save_llama(target, vocab=512, layers=2, quiet_from=0, tail_scale=0.01)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    config = model.config.to_dict() | {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle"]}
    config["num_key_value_heads"] = kv_heads or config["num_key_value_heads"]
    h, d = model.config.hidden_size, model.config.hidden_size // model.config.num_attention_heads
    torch.manual_seed(2)
    layer = {f"layers.0.{k}": v for k, v in model.model.layers[-1].state_dict().items()}
    layer.pop("layers.0.input_layernorm.weight")  # EAGLE's first layer has no input norm
    for name in ("k_proj", "v_proj") if kv_heads else ():
        layer[f"layers.0.self_attn.{name}.weight"] = torch.randn(kv_heads * d, h) * 0.02
    fc = torch.cat((torch.eye(h), torch.randn(h, h) * 0.002), dim=1)
    head = root / ("head" if kv_heads is None else f"head-{kv_heads}")
    head.mkdir()
    save_file(
        {k: v.contiguous() for k, v in (layer | {"fc.weight": fc, "fc.bias": torch.zeros(h)}).items()},
        head / "model.safetensors",
    )
    (head / "config.json").write_text(json.dumps(config, indent=2))
    return target, head


DRAFT_VOCAB = 384  # the EAGLE3 test head's, of the target's 512


def save_eagle3_target_and_head(root: Path, kv_heads: int | None = None, d2t: bool = True) -> tuple[Path, Path]:
    """A 4-layer Llama whose layers barely change the residual stream (output projections x 0.001, so its
    guess is nearly its LM head over the token's embedding; every KV head its own; its LM head ignores feature
    0) and an EAGLE3
    head for it (SGLang's LlamaForCausalLMEagle3 layout: `midlayer.*`, fc, norm, lm_head, d2t, t2d) reading
    the inputs of its layers 1, 2 and 3 (eagle_aux_hidden_state_layer_ids [0, 1, 2]), over a draft
    vocabulary of 384 tokens: every one the target guesses after some token (a real head keeps the most
    frequent ones), then the lowest others. It guesses what the target would, often but not always: fc's
    bias puts a large constant on feature 0 (plus a little of the three hidden states), so hidden_norm gives
    q and k the same vector at every position, on the fastest rotary frequencies: each position attends to
    itself. v takes the normed embedding of the token, o_proj adds it to the residual, the MLP adds nothing
    and the final norm drops feature 0: the draft LM head (the target's rows of the draft vocabulary) sees
    the token's embedding, as the quiet target does. On later draft steps the residual keeps the previous
    token's embedding too, so those guesses are worse. `kv_heads`: another KV head count (its KV does not
    fit the target's pages); `d2t`: False leaves d2t out (refused: the draft vocabulary is smaller)."""
    import json

    from safetensors.torch import save_file

    target = root / "eagle3-target"
    if not target.exists():
        save_llama(target, vocab=512, layers=4, quiet_from=0, tail_scale=0.001, kv_heads=4)
        quiet = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
        with torch.no_grad():
            quiet.lm_head.weight[:, 0] = 0.0  # its guesses ignore feature 0, which the head's fc bias fills
        quiet.save_pretrained(target)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    hot = hot_tokens(model)
    name = "eagle3-head" + (f"-{kv_heads}" if kv_heads else "") + ("" if d2t else "-no-d2t")
    head = root / name
    head.mkdir()
    tensors = eagle3_weights(model, hot, kv_heads or 4)
    if d2t:
        tensors["d2t"] = torch.tensor(hot) - torch.arange(len(hot))
    save_file({k: v.contiguous() for k, v in tensors.items()}, head / "model.safetensors")
    config = model.config.to_dict() | {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"]}
    config |= {"num_key_value_heads": kv_heads or 4, "draft_vocab_size": len(hot), "bias": True}
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    (head / "config.json").write_text(json.dumps(config, indent=2))
    return target, head


def hot_tokens(model: LlamaForCausalLM) -> list[int]:
    """The EAGLE3 test head's draft vocabulary (sorted): the target's guess after each single token first."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        guessed = set(model(torch.arange(vocab)[:, None]).logits[:, 0].argmax(-1).tolist())
    others = [t for t in range(vocab) if t not in guessed]
    return sorted((sorted(guessed) + others)[:DRAFT_VOCAB])


def eagle3_weights(model: LlamaForCausalLM, hot: list[int], kv_heads: int) -> dict[str, torch.Tensor]:
    """The EAGLE3 test head's tensors but d2t (save_eagle3_target_and_head says what they do)."""
    h, d, heads = model.config.hidden_size, 16, model.config.num_attention_heads
    torch.manual_seed(3)
    q = torch.zeros(heads * d, 2 * h)  # columns: cat(normed embedding, normed hidden)
    for i in range(heads):
        q[i * d : i * d + 4, h] = 1.25  # rotary pairs 0-3 (frequencies 1, 0.32, 0.1, 0.03) from hidden feature 0
    v = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    if kv_heads != heads:
        v = torch.randn(kv_heads * d, 2 * h) * 0.02
    norm = model.model.norm.weight.detach().clone()
    norm[0] = 0.0
    layer = {
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": q[: kv_heads * d].clone(),
        "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": torch.eye(h),
        "mlp.gate_proj.weight": torch.randn(128, h) * 0.02,
        "mlp.up_proj.weight": torch.randn(128, h) * 0.02,
        "mlp.down_proj.weight": torch.zeros(h, 128),
        "input_layernorm.weight": torch.ones(h),
        "hidden_norm.weight": torch.ones(h),
        "post_attention_layernorm.weight": torch.ones(h),
    }
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    return {f"midlayer.{k}": t for k, t in layer.items()} | {
        "fc.weight": torch.randn(h, 3 * h) * 0.002,
        "fc.bias": torch.eye(h)[0] * 100.0,
        "norm.weight": norm,
        "lm_head.weight": model.lm_head.weight.detach()[hot].clone(),
        "t2d": t2d,
    }

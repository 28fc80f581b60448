"""Find a model by name or path (common.model.locate), convert GGUF once into a cached safetensors
directory, load it."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from common.model.kv_scales import is_kv_scale
from common.model.llama import MLP, Attention, LlamaForCausalLM
from common.model.locate import check_architecture, converted_dir, existing_model_dir, gguf_source
from common.model.registry import model_class
from common.model.weights import fill_from_shard, plan_shards, read_header
from common.parallel.group import SINGLE, TensorParallel
from common.parallel.layers import param_shards
from common.wire.user_error import UserError

log = logging.getLogger(__name__)


def resolve_model_dir(model: str, flag: str = "--model") -> Path:
    """Return a Hugging Face directory (config.json + safetensors + tokenizer) for `model` (given by `flag`)."""
    found = existing_model_dir(model, flag)
    return found if found is not None else convert_gguf(*gguf_source(model, flag))


def convert_gguf(gguf: Path, name: str) -> Path:
    """Dequantize a GGUF file into float32 safetensors, once; later calls reuse the cached copy."""
    out = converted_dir(gguf, name)
    if (out / ".complete").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once; about a minute)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized already; lets save_pretrained write plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").touch()
    if out.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    check_architecture(model_dir)  # also for a converted GGUF, whose architecture shows only now
    return AutoConfig.from_pretrained(model_dir)


def load_model(
    model_dir: Path, config: PretrainedConfig, dtype: torch.dtype, device: str, tp: TensorParallel = SINGLE
) -> LlamaForCausalLM:
    """The model with its weights created empty in `dtype` on `device` and filled shard by shard, a
    piece of a tensor at a time: no float32 stage and no second copy of the model in host memory. With
    several TP ranks, this rank's share of the weights only."""
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise UserError(f"--model {model_dir}: no *.safetensors weights; give the directory that holds them")
    with torch.device("meta"):
        model = model_class(config)(config, tp)
    materialize(model, dtype, device)
    for module in model.modules():  # fused qkv / gate_up weights, filled through their parts' names
        if isinstance(module, (Attention, MLP)):
            module.fuse(filled=False)
    # a tied lm_head is not listed: it is the embedding
    params = {model.checkpoint_name(n): p for n, p in model.named_parameters()}
    parts = {model.checkpoint_name(n): s for n, s in param_shards(model).items()} if tp.enabled else {}
    skipped = skipped_names(shards, config, set(params) if tp.ep else None)
    for shard, names in plan_shards(shards, params, skipped, parts).items():
        fill_from_shard(shard, names, params, parts)
    return model.eval()


def skipped_names(shards: list[Path], config: PretrainedConfig, ep_params: set[str] | None = None) -> frozenset[str]:
    """Checkpoint tensors that are no parameter: a tied lm_head, KV cache scales (read by
    common.model.kv_scales), layers past num_hidden_layers (DeepSeek-V3's multi-token prediction) and,
    under expert parallelism (`ep_params`: this rank's parameters), the experts other ranks hold."""
    extra_layers = re.compile(r"model\.layers\.(\d+)\.")
    expert = re.compile(r".*\.experts\.\d+\.")
    names = {"lm_head.weight"}
    for shard in shards:
        for name in read_header(shard)[0]:
            layer = extra_layers.match(name)
            if is_kv_scale(name) or (layer and int(layer[1]) >= config.num_hidden_layers):
                names.add(name)
            elif ep_params is not None and name not in ep_params and expert.match(name):
                names.add(name)
    return frozenset(names)


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: str) -> None:
    """Give every meta parameter real, uninitialised storage (a tied one stays tied); buffers follow."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False)
            setattr(module, name, made[id(p)])
    model.to(device)

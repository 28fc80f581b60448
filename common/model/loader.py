"""Find a model by name or path (common.model.locate), convert GGUF once into a cached safetensors
directory, load it."""

from __future__ import annotations

import json
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
from common.quant.int4_prepare import finish_int4
from common.quant.prepare import prepare_quantized, refuse_quantized_tensors
from common.quant.scheme import detect_scheme
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
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as e:  # transformers' reader refuses the file
        raise UserError(
            f"--model {gguf}: this GGUF cannot be read: {str(e).rstrip('.')}; serve a GGUF of a Llama-family model"
        ) from e
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
    model_dir: Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: str,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """The model with its weights created empty in `dtype` on `device` and filled shard by shard, a
    piece of a tensor at a time: no float32 stage and no second copy of the model in host memory. With
    several TP ranks, this rank's share of the weights only. A quantized checkpoint (common.quant; the
    `--quantization` flag insists on a scheme) keeps its quantized weights and their scales."""
    shards = checkpoint_shards(model_dir)
    scheme = detect_scheme(model_dir, config, quantization)
    with torch.device("meta"):
        model = model_class(config)(config, tp)
    header = {n: e for shard in shards for n, e in read_header(shard)[0].items()}
    mine = {model.checkpoint_name(n) for n, _ in model.named_parameters()} if tp.ep else None
    skipped = skipped_names(header, config, mine)
    report = prepare_quantized(model, scheme, header, skipped, model.checkpoint_name, tp.size) if scheme else None
    skipped |= report.activation_scales if report else frozenset()
    if scheme is None:
        refuse_quantized_tensors(header, f"--model {model_dir}")
    materialize(model, dtype, device)
    for module in model.modules():  # fused qkv / gate_up weights, filled through their parts' names
        if fusable(module):
            module.fuse(filled=False)
    # a tied lm_head is not listed: it is the embedding
    params = {model.checkpoint_name(n): p for n, p in model.named_parameters()}
    parts = {model.checkpoint_name(n): s for n, s in param_shards(model).items()} if tp.enabled else {}
    for shard, names in plan_shards(shards, params, skipped, parts).items():
        fill_from_shard(shard, names, params, parts)
    finish_int4(model)
    if report is not None:
        log.info("%s", report.summary(resident_bytes(model), checkpoint_bytes(header, params), device))
    return model.eval()


def fusable(module: torch.nn.Module) -> bool:
    """An attention or MLP whose projections can become one weight: none of them quantized (their
    scales' blocks need not line up with the parts' rows)."""
    return isinstance(module, (Attention, MLP)) and not any(getattr(m, "quant", None) for m in module.children())


def checkpoint_shards(model_dir: Path) -> list[Path]:
    """The safetensors files, each listed one there (model.safetensors.index.json) included."""
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise UserError(f"--model {model_dir}: no *.safetensors weights; give the directory that holds them")
    index = model_dir / "model.safetensors.index.json"
    listed = set(json.loads(index.read_text()).get("weight_map", {}).values()) if index.exists() else set()
    missing = sorted(listed - {s.name for s in shards})
    if missing:
        raise UserError(f"--model {model_dir}: shard {missing[0]} listed in {index.name} is missing; download it again")
    return shards


def resident_bytes(model: torch.nn.Module) -> int:
    return sum({id(p): p.numel() * p.element_size() for p in model.parameters()}.values())


def checkpoint_bytes(header: dict[str, dict], params: dict[str, torch.Tensor]) -> int:
    """The checkpoint's bytes of the tensors this rank's parameters take (whole, not this rank's share)."""
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for n, e in header.items() if n in params)


def skipped_names(
    header: dict[str, dict], config: PretrainedConfig, ep_params: set[str] | None = None
) -> frozenset[str]:
    """Checkpoint tensors that are no parameter: a tied lm_head, KV cache scales (read by
    common.model.kv_scales), layers past num_hidden_layers (DeepSeek-V3's multi-token prediction) and,
    under expert parallelism (`ep_params`: this rank's parameters), the experts other ranks hold."""
    extra_layers = re.compile(r"model\.layers\.(\d+)\.")
    expert = re.compile(r".*\.experts\.\d+\.")
    names = {"lm_head.weight"}
    for name in header:
        layer = extra_layers.match(name)
        if is_kv_scale(name) or (layer and int(layer[1]) >= config.num_hidden_layers):
            names.add(name)
        elif ep_params is not None and layer_weight(name) not in ep_params and expert.match(name):
            names.add(name)
    return frozenset(names)


def layer_weight(name: str) -> str:
    """The `.weight` of the layer a checkpoint tensor belongs to (its scale's, a 4-bit format's tensors')."""
    return re.sub(r"\.[^.]+$", ".weight", name)


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: str) -> None:
    """Give every meta parameter real, uninitialised storage in `dtype` (a quantized layer's in its
    `param_dtypes`; a tied one stays tied); buffers follow."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        fixed = getattr(module, "param_dtypes", {})  # a quantized layer's weight and scale (common.quant)
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                empty = torch.empty(p.shape, dtype=fixed.get(name, dtype), device=device)
                made[id(p)] = torch.nn.Parameter(empty, requires_grad=False)
            setattr(module, name, made[id(p)])
    model.to(device)

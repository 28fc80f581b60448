"""Find a model by name or path (common.model.locate), convert GGUF once into a cached safetensors
directory, load it."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from common.model.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from common.model.locate import converted_dir, existing_model_dir, gguf_source

log = logging.getLogger(__name__)


def resolve_model_dir(model: str) -> Path:
    """Return a Hugging Face directory (config.json + safetensors + tokenizer) for `model`."""
    found = existing_model_dir(model)
    return found if found is not None else convert_gguf(*gguf_source(model))


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
    config = AutoConfig.from_pretrained(model_dir)
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{model_dir}: architecture {arch} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return config


def load_model(model_dir: Path, config: PretrainedConfig, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    state: dict[str, torch.Tensor] = {}
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    for shard in shards:
        state.update(load_file(shard, device="cpu"))
    expected = set(model.state_dict())
    missing = expected - set(state)
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    unexpected = set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False)
    return model.eval()

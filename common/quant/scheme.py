"""Which quantization a checkpoint uses: read from config.json's `quantization_config` (its `quant_method`,
as SGLang and vLLM read it) and checked against `--quantization NAME` when the user insists on one.

Supported: DeepSeek's FP8 blocks (`quant_method: fp8` with `weight_block_size`, e4m3, dynamic activations;
DeepSeek-V3/R1, Kimi K2) and llm-compressor's FP8 (`compressed-tensors`, `float-quantized`: per-tensor or
per-channel weight scales, static or dynamic activations), and 4-bit weight-only checkpoints (AWQ, GPTQ,
compressed-tensors pack-quantized: common.quant.int4_scheme). Everything else SGLang or vLLM name is refused
with one line saying so, before any weight is read. A scheme is also part of the KV layout a PD pair must
share (`describe()`). `--quantization gguf` on a .gguf file serves it kept quantized (common.quant.gguf_load;
its kept directory's config names `quant_method: gguf`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.quant.int4_scheme import SUPPORTED_INT4, Int4Format, awq_format, gptq_format, pack_quantized_format
from common.wire.user_error import UserError

SUPPORTED = (
    "fp8 with weight_block_size (DeepSeek's FP8 blocks: e4m3 weights, dynamic activations), compressed-tensors "
    f"float-quantized (FP8 weights, per-tensor or per-channel scales), {SUPPORTED_INT4}, and gguf on a .gguf "
    "file (its Q4_0, Q4_1 and Q4_K layers kept in 4 bits)"
)
# SGLang's and vLLM's --quantization names (what a user may type); fp8, compressed-tensors, awq and gptq load
# here, and the Marlin spellings name the same checkpoints (`ALIASES`: on the CPU, the same product)
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
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
ALWAYS_UNQUANTIZED = "embed_tokens, lm_head, norms, MoE router gates"


@dataclass(frozen=True)
class QuantScheme:
    """`block`: (rows, columns) of one weight block sharing a scale (strategy "block"); `strategy`: block,
    channel or tensor; `activations`: the checkpoint's activation quantization (dynamic, static, none);
    `ignore`: module names the checkpoint leaves unquantized (`modules_to_not_convert` / `ignore`); `int4`:
    a 4-bit weight-only scheme's layout and groups (strategy "group")."""

    method: str
    block: tuple[int, int] | None
    ignore: tuple[str, ...] = ()
    strategy: str = "block"
    activations: str = "dynamic"
    int4: Int4Format | None = None

    def describe(self) -> str:
        if self.int4 is not None:
            layout = "" if self.int4.layout == self.method else f" {self.int4.layout}"
            return f"{self.method}{layout} {self.int4.describe()}"
        if self.method == "gguf":
            return f"gguf {self.strategy} kept quantized"
        if self.strategy == "block":
            return f"{self.method} block {self.block[0]}x{self.block[1]}"
        return f"{self.method} fp8 per-{self.strategy}, {self.activations} activations"


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
        if flag == "gguf":
            raise UserError(
                f"--quantization gguf: --model {model_dir} is a checkpoint directory with unquantized weights; "
                "gguf serves a .gguf file (--model FILE.gguf, or --model builtin): give one or drop the flag"
            )
        if flag is not None:
            raise UserError(
                f"--quantization {flag}: --model {model_dir} has unquantized weights (no quantization_config in "
                "its config.json) and Tandem quantizes none at load; drop the flag or give a quantized checkpoint"
            )
        return None
    method = qc.get("quant_method")
    if flag is not None and ALIASES.get(flag, flag) != method:
        raise UserError(f"--quantization {flag}: --model {model_dir} is quantized with {method}; drop the flag")
    where = f"--model {model_dir}: quantization_config"
    if method == "compressed-tensors":
        return compressed_tensors_scheme(qc, where)
    if method in ("awq", "gptq"):
        ignore = tuple(qc.get("modules_to_not_convert") or ())
        int4 = awq_format(qc, where) if method == "awq" else gptq_format(qc, where)
        return QuantScheme(method, None, ignore, "group", "none", int4)
    if method == "gguf":  # a GGUF's kept directory (common.model.loader.kept_gguf)
        return QuantScheme("gguf", None, strategy=qc.get("file_type", "?"))
    if method != "fp8":
        raise UserError(f"{where}.quant_method {method} is not supported; Tandem reads {SUPPORTED}")
    return fp8_block_scheme(qc, where)


def compressed_tensors_scheme(qc: dict, where: str) -> QuantScheme:
    """llm-compressor's FP8: every config group 8-bit float weights of one strategy (tensor or channel);
    or its int4 pack-quantized."""
    if qc.get("format") == "pack-quantized":
        int4 = pack_quantized_format(qc, where)
        return QuantScheme("compressed-tensors", None, tuple(qc.get("ignore") or ()), "group", "none", int4)
    if qc.get("format") != "float-quantized":
        raise UserError(f"{where}.format {qc.get('format')} is not supported; Tandem reads {SUPPORTED}")
    strategies, activations = set(), set()
    for name, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations")
        fp8 = (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("dynamic", False)) == (
            8,
            "float",
            True,
            False,
        )
        if not fp8 or w.get("strategy") not in ("tensor", "channel"):
            raise UserError(f"{where}.config_groups.{name}.weights {w} is not supported; Tandem reads {SUPPORTED}")
        if a is not None and (a.get("num_bits"), a.get("type")) != (8, "float"):
            raise UserError(f"{where}.config_groups.{name}.input_activations {a} is not supported (FP8 only)")
        strategies.add(w["strategy"])
        activations.add("none" if a is None else "dynamic" if a.get("dynamic") else "static")
    if len(strategies) != 1 or len(activations) != 1:
        raise UserError(f"{where}.config_groups: give one weight strategy and one activation scheme, not several")
    ignore = tuple(qc.get("ignore") or ())
    return QuantScheme("compressed-tensors", None, ignore, strategies.pop(), activations.pop())


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

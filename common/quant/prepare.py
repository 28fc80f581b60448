"""The loader's quantization step, on the model still on the meta device: every linear layer whose
checkpoint weight is FP8 gets an FP8 weight, its `weight_scale_inv` and the linear method
(common.quant.fp8_block), each of this rank's shape, so the loader fills them as it fills any parameter.
Every problem is found here, from the safetensors headers alone, before any weight is read or any device
memory is taken: a float8 weight without its scale, a scale of the wrong shape, a quantized tensor in a
layer the scheme leaves unquantized."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from common.parallel.layers import ColumnParallelLinear, QuantizableLinear
from common.quant.fp8_block import FP8, FP8_NAME, BlockFP8, ceil_div, fp8_pair
from common.quant.fp8_channel import ChannelFP8, check_channel_pair
from common.quant.fp8_gemm import GROUP, available
from common.quant.int4_prepare import prepare_int4_layer, refuse_int4_strays
from common.quant.scheme import ALWAYS_UNQUANTIZED, QuantScheme
from common.wire.user_error import UserError

SCALE = ".weight_scale_inv"
SCALE_DTYPES = ("F32", "BF16")


@dataclass
class QuantReport:
    """What the start-up summary says of a quantized checkpoint."""

    scheme: QuantScheme
    quantized: int = 0
    unquantized: set[str] = field(default_factory=set)  # linear layers left in full precision, digits as *
    activation_scales: set[str] = field(default_factory=set)  # static `input_scale`s, unread by the loader

    def summary(self, resident: int, checkpoint: int, device: str) -> str:
        kept = f", and linear layers {', '.join(sorted(self.unquantized))}" if self.unquantized else ""
        return (
            f"weights: {self.scheme.describe()} in {self.quantized} linear layers; unquantized: "
            f"{ALWAYS_UNQUANTIZED}{kept}; {resident / 2**20:.2f} MiB resident for {checkpoint / 2**20:.2f} MiB "
            f"in the checkpoint; {kernel(self.scheme, device)}"
        )


def kernel(scheme: QuantScheme, device: str) -> str:
    """Which product the quantized layers run; on CUDA the GEMM's probe runs here, at load, never during a
    CUDA graph's capture."""
    if scheme.int4 is not None:
        return (
            "torch's CPU int4 kernel (bfloat16 activations) where a layer's rows are a multiple of 16, else its "
            "weight dequantized at its product"
        )
    if device == "cuda" and scheme.block == (GROUP, GROUP) and available():
        return "torch's block-scaled FP8 GEMM where a layer's blocks are whole"
    activations = (
        "" if scheme.strategy == "block" else f" (weight-only: {scheme.activations} FP8 activations not applied)"
    )
    return "each layer's weight dequantized at its product" + activations


def prepare_quantized(
    model: nn.Module,
    scheme: QuantScheme,
    header: dict[str, dict],
    skipped: frozenset[str],
    name_of: Callable,
    tp_size: int = 1,
) -> QuantReport:
    """Quantize the meta model's layers the checkpoint quantized; `header`: every shard's entries,
    `skipped`: checkpoint tensors no parameter takes, `name_of`: a parameter's checkpoint name."""
    report, done = QuantReport(scheme), set()
    per_channel = scheme.strategy == "channel"
    for module_name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear):
            continue
        prefix = name_of(f"{module_name}.weight").removesuffix(".weight")
        if scheme.int4 is not None:
            count(report, done, prefix, prepare_int4_layer(module, prefix, header, scheme.int4, tp_size))
            continue
        if prefix + ".weight" in skipped or prefix + ".weight" not in header:
            continue
        block = scheme.strategy == "block"
        if check_pair(prefix, header, scheme.block) if block else check_channel_pair(prefix, header, per_channel):
            quantize(module, scheme.block) if block else quantize_channel(module, per_channel)
            report.quantized += 1
            done.add(prefix)
        else:
            report.unquantized.add(re.sub(r"\.\d+\.", ".*.", prefix))
    if scheme.int4 is not None:
        refuse_int4_strays(header, done, skipped, scheme.method)
        if not done:
            raise UserError(
                f"quantization_config says {scheme.describe()}, but no linear layer of the checkpoint holds a 4-bit "
                "weight; give the quantized checkpoint's own safetensors"
            )
        return report
    report.activation_scales = refuse_strays(header, done, skipped, scheme)
    return report


def count(report: QuantReport, done: set[str], prefix: str, quantized: bool) -> None:
    """One layer in the summary: quantized, or left in full precision."""
    if quantized:
        report.quantized += 1
        done.add(prefix)
    else:
        report.unquantized.add(re.sub(r"\.\d+\.", ".*.", prefix))


def refuse_strays(header: dict[str, dict], done: set[str], skipped: frozenset[str], scheme: QuantScheme) -> set[str]:
    """Refuses a quantized tensor outside the quantized layers; returns the layers' activation scales
    (`input_scale`), which the CPU's weight-only product does not read."""
    activation_scales = {n for n in header if n.endswith(".input_scale") and n.removesuffix(".input_scale") in done}
    for name, entry in header.items():
        base = re.sub(r"\.(weight(_scale(_inv)?)?|input_scale)$", "", name)
        quantized = entry["dtype"] == FP8_NAME or base != name.removesuffix(".weight")
        whole = re.sub(r"_scale(_inv)?$", "", name)
        if quantized and base not in done and name not in skipped and whole not in skipped:
            raise UserError(
                f"{name}: a quantized tensor outside the linear layers {scheme.method} quantizes; Tandem reads "
                f"{ALWAYS_UNQUANTIZED} unquantized"
            )
    return activation_scales


def refuse_quantized_tensors(header: dict[str, dict], where: str) -> None:
    """For a checkpoint whose config names no quantization: a float8 weight or a scale is refused."""
    for name, entry in header.items():
        if entry["dtype"] == FP8_NAME or name.endswith((SCALE, ".qweight", ".weight_packed")):
            raise UserError(
                f"{where}: {name} is quantized ({entry['dtype']}) but config.json has no quantization_config; "
                "give the checkpoint's own config.json"
            )


def check_pair(prefix: str, header: dict[str, dict], block: tuple[int, int]) -> bool:
    """Whether `prefix`'s weight is FP8 with a scale of the right shape (False: unquantized); refuses a
    weight without its scale, a scale without an FP8 weight, a scale of another shape or dtype."""
    pair = fp8_pair(prefix, header, SCALE)
    if pair is None:
        return False
    weight, scale = pair
    rows, cols = weight["shape"]
    want = [ceil_div(rows, block[0]), ceil_div(cols, block[1])]
    if list(scale["shape"]) != want or scale["dtype"] not in SCALE_DTYPES:
        raise UserError(
            f"{prefix}{SCALE}: shape {scale['shape']} {scale['dtype']}, but the weight [{rows}, {cols}] in blocks "
            f"of {block[0]}x{block[1]} needs float32 {want}"
        )
    return True


def quantize(module: QuantizableLinear, block: tuple[int, int]) -> None:
    """This rank's FP8 weight and scale for `module` (meta tensors), and its method."""
    rows, cols = module.weight.shape
    column = isinstance(module, ColumnParallelLinear)
    offset = (module.start % block[0], 0) if column else (0, module.start % block[1])
    module.quant = BlockFP8(block, offset)
    device = module.weight.device
    module.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8, device=device), requires_grad=False)
    scale = torch.empty(module.quant.scale_shape(rows, cols), dtype=torch.float32, device=device)
    module.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
    module.param_dtypes = {"weight": FP8, "weight_scale_inv": torch.float32}


def quantize_channel(module: QuantizableLinear, per_channel: bool) -> None:
    """This rank's FP8 weight and per-channel or per-tensor `weight_scale` (meta tensors), and its method."""
    rows, cols = module.weight.shape
    module.quant = ChannelFP8(per_channel, isinstance(module, ColumnParallelLinear))
    device = module.weight.device
    module.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8, device=device), requires_grad=False)
    scale = torch.empty(module.quant.local_scale_shape(rows, module.out_features), dtype=torch.float32, device=device)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)
    module.param_dtypes = {"weight": FP8, "weight_scale": torch.float32}

"""The loader's quantization step for a 4-bit checkpoint, on the model still on the meta device: every
linear layer whose checkpoint holds the format's packed weight gets this rank's share of the format's own
tensors (common.quant.int4_layouts) as empty parameters and its method (common.quant.int4_linear), which
turns them into the CPU kernel's layout once they are filled. Every problem is found here from the
safetensors headers, before any weight is read: a missing tensor, one of the wrong shape or dtype, a TP
split that cuts a group or a packed int32, act-order inputs split over ranks, a packed tensor outside
the layers the scheme quantizes."""

from __future__ import annotations

import re

import torch
from torch import nn

from common.parallel.layers import ColumnParallelLinear, QuantizableLinear, Shard
from common.quant.int4_layouts import Spec, packed_name, specs
from common.quant.int4_linear import Int4Linear
from common.quant.int4_scheme import Int4Format
from common.wire.user_error import UserError

DTYPES = {"I32": torch.int32, "I64": torch.int64}  # the float scales are kept in float32
INT4_SUFFIXES = (
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
)


def check_layer(prefix: str, header: dict[str, dict], fmt: Int4Format, out: int, inp: int) -> dict[str, Spec]:
    """The layer's tensors present in `header`, each of its spec's shape and dtype."""
    found = {}
    for suffix, spec in specs(fmt, out, inp).items():
        entry = header.get(f"{prefix}.{suffix}")
        if entry is None:
            if spec.required:
                names = ", ".join(s for s, sp in specs(fmt, out, inp).items() if sp.required)
                raise UserError(f"{prefix}.{suffix} is missing; a {fmt.layout} {fmt.describe()} layer needs {names}")
            continue
        if tuple(entry["shape"]) != spec.shape or entry["dtype"] not in spec.dtypes:
            raise UserError(
                f"{prefix}.{suffix}: shape {entry['shape']} {entry['dtype']}, but the weight [{out}, {inp}] in "
                f"{fmt.layout} {fmt.describe()} needs {'/'.join(spec.dtypes)} {list(spec.shape)}"
            )
        found[suffix] = spec
    return found


def rank_share(prefix: str, name: str, spec: Spec, module: QuantizableLinear, tp_size: int) -> Shard | None:
    """This rank's share of one tensor (None: whole); a split inside one of its entries is refused."""
    column = isinstance(module, ColumnParallelLinear)
    full = module.out_features if column else module.in_features
    dim, width = spec.out_dim if column else spec.in_dim
    if (module.start, module.stop) == (0, full) or dim is None or width == 0:
        return None
    if module.start % width or module.stop % width:
        side = "outputs" if column else "inputs"
        what = "a packed int32 of 8" if width == 8 else f"a group of {width}"
        raise UserError(
            f"{prefix}.{name}: --tp-size {tp_size} gives a rank its {side} [{module.start}, {module.stop}), which "
            f"cuts {what}; use a --tp-size that splits the layer's {full} {side} on whole groups"
        )
    return Shard(dim, module.start // width, module.stop // width, spec.shape)


def local_shape(spec: Spec, share: Shard | None) -> tuple[int, ...]:
    if share is None:
        return spec.shape
    shape = list(spec.shape)
    shape[share.dim] = share.stop - share.start
    return tuple(shape)


def quantize_int4(
    module: QuantizableLinear, prefix: str, found: dict[str, Spec], header: dict, fmt: Int4Format, tp_size: int
) -> None:
    """This rank's empty checkpoint tensors on `module` (its `weight` goes), their shares and its method."""
    column = isinstance(module, ColumnParallelLinear)
    if fmt.act_order and not column and tp_size > 1 and module.stop - module.start != module.in_features:
        raise UserError(
            f"{prefix}: desc_act (act-order) orders its inputs' groups at random, and --tp-size {tp_size} splits "
            "its inputs, so every rank would need every group; serve it at --tp-size 1 or use a checkpoint without "
            "desc_act"
        )
    local_in = module.in_features if column else module.stop - module.start
    group = local_in if fmt.group == -1 else fmt.group
    first_group = 0 if column or fmt.act_order else module.start // group
    device, shares, dtypes = module.weight.device, {}, {}
    del module.weight
    for name, spec in found.items():
        share = rank_share(prefix, name, spec, module, tp_size)
        dtype = DTYPES.get(header[f"{prefix}.{name}"]["dtype"], torch.float32)
        empty = torch.empty(local_shape(spec, share), dtype=dtype, device=device)
        setattr(module, name, nn.Parameter(empty, requires_grad=False))
        dtypes[name] = dtype
        if share is not None:
            shares[name] = share
    module.quant = Int4Linear(fmt, group, first_group, tuple(found), prefix)
    module.param_dtypes = dtypes
    module.int4_shares = shares


def prepare_int4_layer(
    module: QuantizableLinear, prefix: str, header: dict[str, dict], fmt: Int4Format, tp_size: int
) -> bool:
    """Quantize `module` when its checkpoint holds the format's packed weight (False: unquantized)."""
    if f"{prefix}.{packed_name(fmt)}" not in header:
        return False
    found = check_layer(prefix, header, fmt, module.out_features, module.in_features)
    quantize_int4(module, prefix, found, header, fmt, tp_size)
    return True


def refuse_int4_strays(header: dict[str, dict], done: set[str], skipped: frozenset[str], method: str) -> None:
    """A 4-bit format's tensor outside the layers prepared is refused (an embedding, a norm, ...)."""
    suffix = re.compile(r"\.(" + "|".join(INT4_SUFFIXES) + r")$")
    for name in header:
        found = suffix.search(name)
        if found and name[: found.start()] not in done and name not in skipped:
            raise UserError(
                f"{name}: a quantized tensor outside the linear layers {method} quantizes; Tandem reads "
                "embed_tokens, lm_head, norms and MoE router gates unquantized"
            )


def finish_int4(model: nn.Module) -> None:
    """Every 4-bit layer's filled checkpoint tensors into the CPU product's layout, one layer at a time."""
    for module in model.modules():
        if isinstance(getattr(module, "quant", None), Int4Linear):
            module.quant.finish(module)
            module.param_dtypes, module.int4_shares = {}, {}

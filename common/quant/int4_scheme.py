"""The 4-bit weight-only schemes read from `quantization_config`: AutoAWQ's GEMM layout (`quant_method:
awq`), GPTQ (`quant_method: gptq`, with or without `desc_act`, checkpoint_format gptq or gptq_v2) and
compressed-tensors' `pack-quantized` (llm-compressor's W4A16: int4 weights, strategy group or channel).
Each becomes a QuantScheme of strategy "group" whose `int4` says the layout (common.quant.int4_layouts),
the group size (-1 or a channel strategy: one group per row, the whole input), whether zero points are
stored, and GPTQ's act-order. Anything else of these three is refused in one line naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from common.wire.user_error import UserError

BITS = 4
GROUPS = (32, 64, 128, -1)
SUPPORTED_INT4 = (
    "4-bit awq (version gemm), gptq (desc_act or not, checkpoint_format gptq or gptq_v2) and compressed-tensors "
    "pack-quantized (int4 weights, strategy group or channel, no activation quantization), group size 32, 64, 128 "
    "or -1 (per channel)"
)


@dataclass(frozen=True)
class Int4Format:
    """`layout`: awq, gptq, gptq_v2 (zero points stored without v1's "-1") or pack-quantized; `group`: input
    columns per scale (-1: all of them); `zero_points`: asymmetric (zero points stored); `act_order`: GPTQ's
    desc_act, a `g_idx` that permutes the input columns."""

    layout: str
    group: int
    zero_points: bool
    act_order: bool = False

    def describe(self) -> str:
        group = "per-channel" if self.group == -1 else f"group {self.group}"
        zeros = "zero points" if self.zero_points else "symmetric"
        return f"int4 {group}, {zeros}" + (", act-order" if self.act_order else "")


def refuse(where: str, field: str, value) -> UserError:
    return UserError(f"{where}.{field} {value} is not supported; Tandem reads {SUPPORTED_INT4}")


def check_bits_and_group(where: str, bits, group) -> None:
    if bits != BITS:
        raise refuse(where, "bits", bits)
    if group not in GROUPS:
        raise refuse(where, "group_size", group)


def awq_format(qc: dict, where: str) -> Int4Format:
    check_bits_and_group(where, qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size")))
    if str(qc.get("version", "gemm")).lower() != "gemm":
        raise refuse(where, "version", qc.get("version"))
    return Int4Format("awq", qc.get("group_size", qc.get("q_group_size")), bool(qc.get("zero_point", True)))


def gptq_format(qc: dict, where: str) -> Int4Format:
    check_bits_and_group(where, qc.get("bits"), qc.get("group_size"))
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise refuse(where, "checkpoint_format", checkpoint_format)
    act_order = bool(qc.get("desc_act", False))
    return Int4Format(checkpoint_format, qc["group_size"], not qc.get("sym", True), act_order)


def pack_quantized_format(qc: dict, where: str) -> Int4Format:
    """One int4 weight scheme for every config group (llm-compressor's W4A16, symmetric or asymmetric)."""
    formats = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w, at = group.get("weights") or {}, f"{where}.config_groups.{name}"
        if group.get("input_activations") is not None:
            raise refuse(at, "input_activations", group["input_activations"])
        if (w.get("num_bits"), w.get("type"), w.get("dynamic", False)) != (BITS, "int", False):
            raise refuse(at, "weights", w)
        if w.get("strategy") not in ("group", "channel") or w.get("actorder") not in (None, False):
            raise refuse(at, "weights", w)
        size = w.get("group_size") if w["strategy"] == "group" else -1
        check_bits_and_group(at + ".weights", w["num_bits"], size)
        formats.add(Int4Format("pack-quantized", size, not w.get("symmetric", True)))
    if len(formats) != 1:
        raise UserError(f"{where}.config_groups: give one int4 weight scheme, not {len(formats)}")
    return formats.pop()

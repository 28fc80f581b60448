"""Fill a model's parameters from safetensors shards through one small host buffer.

The file is read with plain reads, CHUNK_BYTES at a time, and each piece is cast and copied into its
parameter on the model's device. safetensors' own `safe_open` maps the whole file instead: the pages it
touches count in the process's resident memory until the file is closed, which for a one-shard 1B model
doubles the peak (benchmarks/load_memory.py). The format is an 8-byte little-endian header length, a
JSON header {name: {dtype, shape, data_offsets}} and the raw tensor bytes after it.

A tensor-parallel rank fills only its shard of a tensor (a `Shard` from common.parallel.layers): rows are
one contiguous byte range, read alone; columns are cut from whole rows read a chunk at a time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from common.parallel.layers import Shard
from common.wire.user_error import UserError

CHUNK_BYTES = 64 * 1024 * 1024
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,  # a quantized layer's weight (common.quant), into an FP8 parameter
    "I32": torch.int32,  # a 4-bit layer's packed weight and zero points, GPTQ's g_idx (common.quant.int4_layouts)
    "I64": torch.int64,  # compressed-tensors' weight_shape
}


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """The shard's tensor entries (without __metadata__) and the file offset where their bytes start;
    a UserError for a file that is no safetensors file or ends before its tensors do."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        try:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length)) if 8 + length <= size else None
        except (struct.error, ValueError):
            header = None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (its header cannot be read); download it again")
    header.pop("__metadata__", None)
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    if 8 + length + end > size:
        raise UserError(f"{path}: truncated ({size} bytes of {8 + length + end}; an interrupted download?)")
    return header, 8 + length


def plan_shards(
    shards: list[Path],
    params: dict[str, torch.Tensor],
    ignore: frozenset[str],
    tp_shards: dict[str, Shard] | None = None,
) -> dict[Path, list[str]]:
    """Which parameters each shard fills; raises unless together they fill every one, with its (whole)
    shape and a float dtype. Names in `ignore` (a tied lm_head) may be in a shard and are skipped."""
    plan: dict[Path, list[str]] = {}
    tp_shards = tp_shards or {}
    for shard in shards:
        header, _ = read_header(shard)
        unexpected = sorted(n for n in header if n not in params and n not in ignore)
        wrong = [n for n in header if n in params and list(header[n]["shape"]) != _full_shape(n, params, tp_shards)]
        odd = sorted({header[n]["dtype"] for n in header if n in params} - set(DTYPES))
        if unexpected or wrong or odd:
            raise UserError(
                f"{shard}: weights do not fit the model: unexpected {unexpected[:5]}, wrong shape {wrong[:5]}, "
                f"dtypes {odd} (float32/float16/bfloat16/float64, float8 and int32 in a quantized checkpoint)"
            )
        plan[shard] = [n for n in header if n in params]
    missing = set(params) - {n for names in plan.values() for n in names}
    if missing:
        raise UserError(f"{shards[0].parent}: weights do not fit the model: missing {sorted(missing)[:5]}")
    return plan


def _full_shape(name: str, params: dict[str, torch.Tensor], tp_shards: dict[str, Shard]) -> list[int]:
    return list(tp_shards[name].full_shape) if name in tp_shards else list(params[name].shape)


@torch.no_grad()
def fill_from_shard(
    path: Path, names: list[str], params: dict[str, torch.Tensor], tp_shards: dict[str, Shard] | None = None
) -> None:
    """Copy the tensors `names` of one shard into `params` (any dtype, any device); a name in `tp_shards`
    gets only its rank's slice."""
    header, data_start = read_header(path)
    buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    with open(path, "rb") as fh:
        for name in names:
            entry, out, part = header[name], params[name], (tp_shards or {}).get(name)
            dtype, offset = DTYPES[entry["dtype"]], data_start + entry["data_offsets"][0]
            if part is None:
                fh.seek(offset)
                _copy_tensor(fh, buffer, dtype, out.view(-1))
            elif part.dim == 0:
                _copy_rows(fh, offset, buffer, dtype, part, out)
            else:
                _copy_columns(fh, offset, dtype, part, out)


def _copy_rows(fh: BinaryIO, offset: int, buffer: torch.Tensor, dtype: torch.dtype, part: Shard, out: torch.Tensor):
    """Rows [start, stop) of the tensor: one byte range; rows past its end (vocabulary padding) are zero."""
    row = out[0].numel() if out.dim() > 1 else 1
    have = max(0, min(part.stop, part.full_shape[0]) - part.start)
    fh.seek(offset + part.start * row * dtype.itemsize)
    _copy_tensor(fh, buffer, dtype, out.view(-1)[: have * row])
    out.view(-1)[have * row :].zero_()


def _copy_columns(fh: BinaryIO, offset: int, dtype: torch.dtype, part: Shard, out: torch.Tensor) -> None:
    """Columns [start, stop) of a 2-d tensor, cut from whole rows read a chunk at a time."""
    rows, cols = part.full_shape
    step = max(1, CHUNK_BYTES // (cols * dtype.itemsize))
    buffer = torch.empty(step * cols * dtype.itemsize, dtype=torch.uint8)
    fh.seek(offset)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        piece = buffer[: n * cols * dtype.itemsize]
        _read_exactly(fh, memoryview(piece.numpy()))
        out[start : start + n].copy_(piece.view(dtype).view(n, cols)[:, part.start : part.stop])


def _copy_tensor(fh: BinaryIO, buffer: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    step = CHUNK_BYTES // dtype.itemsize
    for start in range(0, out.numel(), step):
        n = min(step, out.numel() - start)
        piece = buffer[: n * dtype.itemsize]
        _read_exactly(fh, memoryview(piece.numpy()))
        out[start : start + n].copy_(piece.view(dtype))


def _read_exactly(fh: BinaryIO, out: memoryview) -> None:
    done = 0
    while done < len(out):
        got = fh.readinto(out[done:])
        if not got:
            raise UserError(f"{fh.name}: the file ends early (an interrupted download?)")
        done += got

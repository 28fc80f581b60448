"""GGUF kept quantized without a server: each read type unpacked from files the `gguf` package wrote equals
its own dequantizer (`gguf.quants.dequantize`) value for value; the 4-bit types' int4 form is the same
weight (within float32 rounding) and the kernel's product that weight's within bfloat16 rounding; the
built-in file read our way equals transformers' GGUF loader's float32 copy; and the refusals name the tensor."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from common.parallel.layers import ColumnParallelLinear, Shard
from common.quant.gguf_load import keep_int4, permuted, read_tensors
from common.quant.gguf_unpack import BLOCK_BYTES, dense, unpack
from common.quant.int4_cpu import Int4Weight
from common.quant.int4_cpu import dequantize as int4_dequantize
from common.quant.scheme import describe_weights, detect_scheme
from common.wire.user_error import UserError

ROWS, COLUMNS = 32, 512
SCALE_BYTES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q8_0: [0], T.Q6_K: [208]}  # f16 d (and m) offsets


def raw_blocks(kind: T, rng: np.random.Generator) -> np.ndarray:
    """Random blocks in `kind`'s on-disk layout, their f16 scales small and finite (every code is random)."""
    per = 256 if kind in (T.Q4_K, T.Q6_K) else 32
    blocks = rng.integers(0, 256, (ROWS, COLUMNS // per, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in SCALE_BYTES[kind]:
        blocks[..., at : at + 2] = rng.normal(0, 0.02, (ROWS, COLUMNS // per, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(ROWS, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, T]], arch: str = "llama") -> Path:
    writer = GGUFWriter(path, arch)
    for name, (data, kind) in tensors.items():
        float_type = kind in (T.F32, T.F16)
        writer.add_tensor(name, data, raw_dtype=None if float_type else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> GGUFReader:
    """A file of every read type: Q4_0, Q4_1 and Q8_0 quantized by the package, Q4_K and Q6_K random blocks."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (ROWS, COLUMNS)).astype(np.float32)
    tensors = {f"{k.name}.weight": (quantize(w, k), k) for k in (T.Q4_0, T.Q4_1, T.Q8_0)}
    tensors |= {f"{k.name}.weight": (raw_blocks(k, rng), k) for k in (T.Q4_K, T.Q6_K)}
    tensors |= {"F32.weight": (w, T.F32), "F16.weight": (w.astype(np.float16), T.F16)}
    return GGUFReader(write_gguf(tmp_path_factory.mktemp("gguf") / "types.gguf", tensors))


def test_every_read_type_unpacks_to_the_gguf_packages_own_dequantization(written):
    assert len(written.tensors) == 7
    for t in written.tensors:
        theirs = dequantize(t.data, t.tensor_type).reshape(ROWS, COLUMNS)
        ours = dense(t.data, t.tensor_type, COLUMNS)
        assert ours.dtype == torch.float32 and np.array_equal(ours.numpy(), theirs), t.name


def test_the_4_bit_types_int4_form_is_the_same_weight_and_the_kernel_computes_it(written):
    x = torch.randn(3, COLUMNS)
    for t in written.tensors:
        if t.tensor_type not in (T.Q4_0, T.Q4_1, T.Q4_K):
            continue
        theirs = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(ROWS, COLUMNS).copy())
        codes, scales, offsets = unpack(t.data, t.tensor_type, COLUMNS).int4()
        assert codes.min() >= 0 and codes.max() <= 15
        torch.testing.assert_close(int4_dequantize(codes, scales, offsets, 32), theirs, rtol=0, atol=1e-6)
        product = Int4Weight.pack(codes, scales, offsets, 32).product(x)
        b16 = lambda t: t.bfloat16().float()  # noqa: E731  the kernel's dtype for x, scales and offsets
        as_kernel = int4_dequantize(codes, b16(scales), b16(offsets), 32)
        torch.testing.assert_close(product, b16(b16(x) @ as_kernel.T), rtol=0.01, atol=0.01 * product.abs().max())


def test_the_builtin_file_read_our_way_equals_transformers_gguf_loader(builtin_model_dir):
    from safetensors import safe_open

    from common.model.loader import load_hf_config
    from common.model.locate import builtin_gguf_path

    config, tensors = load_hf_config(builtin_model_dir), read_tensors(builtin_gguf_path())
    names = [n for n in tensors if n.startswith("model.layers.0.") or not n.startswith("model.layers.")]
    assert len(names) == 11  # layer 0's nine (q and k rows permuted back), the embedding (Q8_0), the final norm
    with safe_open(builtin_model_dir / "model.safetensors", "pt") as theirs:
        for name in names:
            t = tensors[name]
            ours = permuted(dense(t.raw, t.kind, t.shape[-1]).view(t.shape), name, config)
            assert torch.equal(ours, theirs.get_tensor(name)), name


def test_an_unsupported_type_and_architecture_are_refused_naming_them(tmp_path):
    q5 = np.zeros((ROWS, COLUMNS // 32 * 22), dtype=np.uint8)
    path = write_gguf(tmp_path / "q5.gguf", {"blk.0.attn_q.weight": (q5, T.Q5_0)})
    with pytest.raises(
        UserError, match=r"q5.gguf: blk.0.attn_q.weight is of GGUF type Q5_0; --quantization gguf reads"
    ):
        read_tensors(path)
    path = write_gguf(tmp_path / "qwen.gguf", {"x.weight": (np.zeros(4, np.float32), T.F32)}, arch="qwen2")
    with pytest.raises(UserError, match="a GGUF of architecture qwen2; Tandem keeps only Llama-family GGUFs"):
        read_tensors(path)


def test_a_shape_the_kernel_refuses_is_dequantized_and_a_split_inside_a_group_refused(tmp_path, caplog):
    rng = np.random.default_rng(1)
    small = SimpleNamespace(
        name="blk.0.ffn_up.weight", raw=quantize(rng.normal(size=(8, 64)).astype(np.float32), T.Q4_0)
    )
    tensor = SimpleNamespace(**vars(small), kind=T.Q4_0, shape=(8, 64))
    with torch.device("meta"):
        layer = ColumnParallelLinear(64, 8, False)
    with caplog.at_level(logging.WARNING):
        assert not keep_int4(layer, "model.layers.0.mlp.up_proj", tensor, None, None)
    assert "blk.0.ffn_up.weight: [8, 64] does not fit the int4 kernel" in caplog.text and layer.quant is None
    cut = Shard(1, 16, 48, (8, 64))
    with pytest.raises(
        UserError, match=r"blk.0.ffn_up.weight: columns \[16, 48\) of this TP rank cut its groups of 32"
    ):
        keep_int4(layer, "model.layers.0.mlp.up_proj", tensor, cut, None)


def test_the_kept_directorys_scheme_is_part_of_the_kv_layout():
    hf = SimpleNamespace(quantization_config={"quant_method": "gguf", "file_type": "Q4_1"})
    scheme = detect_scheme(Path("m"), hf, "gguf")
    assert describe_weights(scheme) == "gguf Q4_1 kept quantized" and describe_weights(None) == "none"

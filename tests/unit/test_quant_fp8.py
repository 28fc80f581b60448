"""DeepSeek's FP8 blocks without a model: the scheme read from quantization_config (and refused with one
line naming the field), the block dequantization against an independent reading of the format, whole and
as any TP rank's rows or columns (blocks split between ranks included), and the loader's refusals of a
missing, mis-shaped or misplaced scale before any weight is read."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.model.loader import load_hf_config, load_model
from common.parallel.layers import Shard
from common.quant.fp8_block import BlockFP8
from common.quant.scheme import QuantScheme, detect_scheme
from common.wire.user_error import UserError
from tests.integration.fp8_models import dequantize_block, quantize_block, to_fp8_block
from tests.integration.tiny_model import save_tiny_llama

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def config(qc: dict | None):
    return SimpleNamespace(quantization_config=qc) if qc is not None else SimpleNamespace()


def test_the_scheme_is_read_from_quantization_config_and_the_flag_may_insist():
    assert detect_scheme("m", config(None)) is None
    assert detect_scheme("m", config(FP8), "fp8") == QuantScheme("fp8", (128, 128))
    ignored = detect_scheme("m", config(FP8 | {"modules_to_not_convert": ["lm_head"]}))
    assert (ignored.ignore, ignored.describe()) == (("lm_head",), "fp8 block 128x128")


@pytest.mark.parametrize(
    "qc, flag, said",
    [
        (
            {"quant_method": "bitsandbytes"},
            None,
            "--model m: quantization_config.quant_method bitsandbytes is not supported",
        ),
        ({"quant_method": "fp8"}, None, "fp8 without weight_block_size (per-tensor scales) is not supported"),
        (FP8 | {"weight_block_size": [128]}, None, "weight_block_size [128]: give two positive block sizes"),
        (FP8 | {"fmt": "e5m2"}, None, "quantization_config.fmt e5m2 is not supported"),
        (FP8 | {"activation_scheme": "static"}, None, "activation_scheme static is not supported"),
        (FP8, "gptq", "--quantization gptq: --model m is quantized with fp8; drop the flag"),
        (None, "fp8", "--quantization fp8: --model m has unquantized weights"),
        (
            None,
            "gguf",
            "--quantization gguf: --model m is a checkpoint directory with unquantized weights; gguf serves",
        ),
        (None, "int3", "--quantization int3: not a quantization method; Tandem reads fp8 with weight_block_size"),
    ],
)
def test_an_unsupported_scheme_is_one_line_naming_the_field(qc, flag, said):
    with pytest.raises(UserError, match=re.escape(said)):
        detect_scheme("m", config(qc), flag)


@pytest.mark.parametrize("block", [(16, 16), (128, 128), (8, 32)])
def test_dequantize_equals_the_format_whole_and_as_any_rank_slice(block):
    w = torch.randn(70, 50)
    q, scale = quantize_block(w, block)
    want = dequantize_block(q, scale, block)
    assert (want - w).abs().max() < 0.07 * w.abs().max()  # FP8's own rounding: 3 mantissa bits
    method = BlockFP8(block)
    assert torch.equal(method.dequantize(q, scale, torch.float32), want)
    for dim, (start, stop) in [(0, (20, 45)), (0, (33, 70)), (1, (9, 50)), (1, (0, 17))]:
        part = method.scale_shard(Shard(dim, start, stop, (70, 50)))
        offset = (start % block[0], 0) if dim == 0 else (0, start % block[1])
        rank = BlockFP8(block, offset)
        rows = slice(start, stop) if dim == 0 else slice(None)
        cols = slice(start, stop) if dim == 1 else slice(None)
        scale_rows = slice(part.start, part.stop) if dim == 0 else slice(None)
        scale_cols = slice(part.start, part.stop) if dim == 1 else slice(None)
        mine = scale[scale_rows, scale_cols]
        assert rank.scale_shape(*q[rows, cols].shape) == tuple(mine.shape)
        assert torch.equal(rank.dequantize(q[rows, cols], mine, torch.float32), want[rows, cols])


@pytest.fixture
def fp8_dir(tmp_path):
    return to_fp8_block(save_tiny_llama(tmp_path / "src"), tmp_path / "fp8", (32, 32))


def edit(model_dir, change) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


def test_fp8_weights_load_as_fp8_with_their_scales(fp8_dir):
    model = load_model(fp8_dir, load_hf_config(fp8_dir), torch.float32, "cpu")
    q = model.model.layers[0].self_attn.q_proj
    assert (q.weight.dtype, q.weight_scale_inv.shape) == (torch.float8_e4m3fn, (2, 2))
    assert model.model.layers[0].self_attn.qkv is None  # quantized projections stay apart
    state = load_file(fp8_dir / "model.safetensors")
    assert torch.equal(q.weight.view(torch.uint8), state["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda s: s.pop("model.layers.1.mlp.up_proj.weight_scale_inv"), "model.layers.1.mlp.up_proj.weight is float8"),
        (
            lambda s: s.update({"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 2)}),
            r"model.layers.0.mlp.down_proj.weight_scale_inv: shape \[2, 2\] F32, but the weight \[64, 128\] in blocks "
            r"of 32x32 needs float32 \[2, 4\]",
        ),
        (
            lambda s: s.update({"model.embed_tokens.weight": s["model.embed_tokens.weight"].to(torch.float8_e4m3fn)}),
            "model.embed_tokens.weight: a quantized tensor outside the linear layers fp8 quantizes",
        ),
    ],
)
def test_a_missing_misshaped_or_misplaced_scale_is_named(fp8_dir, change, said):
    edit(fp8_dir, change)
    with pytest.raises(UserError, match=said):
        load_model(fp8_dir, load_hf_config(fp8_dir), torch.float32, "cpu")


def test_float8_weights_without_a_quantization_config_are_refused(fp8_dir):
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="is quantized .* but config.json has no quantization_config"):
        load_model(fp8_dir, load_hf_config(fp8_dir), torch.float32, "cpu")


def test_nextn_over_a_quantized_checkpoint_is_refused_in_one_line():
    from common.model.nextn import check_nextn

    hf = SimpleNamespace(num_nextn_predict_layers=1, quantization_config=FP8)
    with pytest.raises(UserError, match="NEXTN: m is quantized \\(fp8\\) and Tandem reads no quantized MTP layer"):
        check_nextn(hf, "m")


def test_reserve_buffers_allocates_what_the_first_forward_uses(fp8_dir):
    """The buffers every FP8 layer dequantizes into exist before the KV pool is sized (rank_model on CUDA):
    a forward afterwards allocates none."""
    from common.quant import fp8_block

    fp8_block._buffers.clear()
    model = load_model(fp8_dir, load_hf_config(fp8_dir), torch.bfloat16, "cpu")
    shapes = {m.weight.shape for m in model.modules() if getattr(m, "quant", None) is not None}
    reserved = fp8_block.reserve_buffers(model, torch.bfloat16)
    assert reserved == sum(s.numel() * (4 + 2) for s in shapes) and len(fp8_block._buffers) == 2 * len(shapes)
    model.model.layers[0].mlp(torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16))
    assert len(fp8_block._buffers) == 2 * len(shapes)
    assert fp8_block.reserve_buffers(model, torch.bfloat16) == 0

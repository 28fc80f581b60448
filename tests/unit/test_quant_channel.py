"""compressed-tensors FP8 without a server: the scheme read from its config groups (and what is refused,
in one line naming the field), the per-channel and per-tensor dequantization, whole and as a TP rank's
rows or columns, and the loader's refusals of a missing or mis-shaped `weight_scale`."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.model.loader import load_hf_config, load_model
from common.parallel.layers import Shard
from common.quant.fp8_channel import ChannelFP8
from common.quant.scheme import QuantScheme, detect_scheme
from common.wire.user_error import UserError
from tests.integration.fp8_models import to_compressed_fp8
from tests.integration.tiny_model import save_tiny_llama

WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


def ct(weights=WEIGHTS, acts=TOKEN, fmt="float-quantized") -> SimpleNamespace:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }
    return SimpleNamespace(quantization_config=qc)


def test_the_scheme_comes_from_the_config_groups():
    assert detect_scheme("m", ct(), "compressed-tensors") == QuantScheme(
        "compressed-tensors", None, ("lm_head",), "channel", "dynamic"
    )
    static = detect_scheme("m", ct(WEIGHTS | {"strategy": "tensor"}, TOKEN | {"dynamic": False}))
    assert static.describe() == "compressed-tensors fp8 per-tensor, static activations"


@pytest.mark.parametrize(
    "config, said",
    [
        (ct(fmt="marlin-24"), "quantization_config.format marlin-24 is not supported"),
        (ct(WEIGHTS | {"num_bits": 4, "type": "int"}), "quantization_config.config_groups.group_0.weights"),
        (ct(WEIGHTS | {"strategy": "group"}), "quantization_config.config_groups.group_0.weights"),
        (ct(acts=TOKEN | {"type": "int"}), "group_0.input_activations"),
    ],
)
def test_what_compressed_tensors_writes_that_tandem_does_not_read_is_named(config, said):
    with pytest.raises(UserError, match=re.escape(said)):
        detect_scheme("m", config)


@pytest.mark.parametrize("per_channel", [True, False])
def test_dequantize_whole_and_as_a_rank_share(per_channel):
    q = torch.randn(12, 8).to(torch.float8_e4m3fn)
    scale = torch.rand(12, 1) if per_channel else torch.rand(1)
    want = q.float() * scale.view(-1, 1)
    assert torch.equal(ChannelFP8(per_channel, True).dequantize(q, scale, torch.float32), want)
    column = ChannelFP8(per_channel, column=True)
    part = column.scale_shard(Shard(0, 4, 9, (12, 8)))
    mine = scale[part.start : part.stop] if per_channel else scale
    assert (part is None) == (not per_channel)
    assert torch.equal(column.dequantize(q[4:9], mine, torch.float32), want[4:9])
    row = ChannelFP8(per_channel, column=False)  # columns split: every row's scale
    assert row.scale_shard(Shard(1, 2, 6, (12, 8))) is None
    assert torch.equal(row.dequantize(q[:, 2:6], scale, torch.float32), want[:, 2:6])


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda s: s.pop("model.layers.0.mlp.up_proj.weight_scale"), "model.layers.0.mlp.up_proj.weight is float8 but"),
        (
            lambda s: s.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(3, 1)}),
            "model.layers.0.mlp.up_proj.weight_scale: shape [3, 1] F32, but the scheme needs float32 [128, 1]",
        ),
    ],
)
def test_a_missing_or_misshaped_weight_scale_is_named(tmp_path, change, said):
    model_dir = to_compressed_fp8(save_tiny_llama(tmp_path / "src"), tmp_path / "ct")
    state = load_file(model_dir / "model.safetensors")
    change(state)
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=re.escape(said)):
        load_model(model_dir, load_hf_config(model_dir), torch.float32, "cpu")

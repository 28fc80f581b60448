"""4-bit weight-only checkpoints without a server: the schemes read from quantization_config (and what is
refused, in one line naming the field), each layout's unpacking against a reading that is not ours
(compressed-tensors' decompression through transformers, its AutoAWQConverter, GPTQ's dequantized twin),
the layer's product, any TP rank's share equal to its slice of the whole, and the loader's refusals of a
missing or mis-shaped tensor and of a split that cuts a group, before any weight is read."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from common.model.loader import load_hf_config, load_model
from common.parallel.group import TensorParallel
from common.quant.int4_cpu import dequantize
from common.quant.int4_layouts import unpack
from common.quant.scheme import describe_weights, detect_scheme
from common.wire.kv_layout import layout_mismatch
from common.wire.user_error import UserError
from tests.integration.int4_models import to_awq, to_gptq, to_pack_quantized
from tests.integration.moe_models import save_family
from tests.integration.test_architectures import save_tiny
from tests.integration.tiny_model import save_tiny_llama

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True}
PACKED = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}


def config(qc: dict) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=qc)


def ct(weights=PACKED, acts=None) -> SimpleNamespace:
    groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}
    return config({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups})


def test_the_schemes_and_the_flags_that_name_them():
    assert detect_scheme("m", config(AWQ), "awq_marlin").describe() == "awq int4 group 128, zero points"
    assert detect_scheme("m", config(GPTQ), "gptq").describe() == "gptq int4 group 64, symmetric, act-order"
    v2 = detect_scheme("m", config(GPTQ | {"checkpoint_format": "gptq_v2", "desc_act": False}), "gptq_marlin")
    assert v2.describe() == "gptq gptq_v2 int4 group 64, symmetric"
    packed = detect_scheme("m", ct(), "compressed-tensors")
    assert describe_weights(packed) == "compressed-tensors pack-quantized int4 group 32, zero points"
    channel = detect_scheme("m", ct(PACKED | {"strategy": "channel", "symmetric": True}))
    assert channel.describe() == "compressed-tensors pack-quantized int4 per-channel, symmetric"


@pytest.mark.parametrize(
    "cfg, flag, said",
    [
        (config(AWQ | {"bits": 3}), None, "quantization_config.bits 3 is not supported; Tandem reads 4-bit awq"),
        (config(AWQ | {"bits": 8}), None, "quantization_config.bits 8 is not supported"),
        (config(AWQ | {"group_size": 16}), None, "quantization_config.group_size 16 is not supported"),
        (config(AWQ | {"version": "gemv"}), None, "quantization_config.version gemv is not supported"),
        (config(GPTQ | {"checkpoint_format": "marlin"}), None, "quantization_config.checkpoint_format marlin"),
        (ct(acts={"num_bits": 8, "type": "int"}), None, "config_groups.group_0.input_activations"),
        (ct(PACKED | {"num_bits": 8}), None, "config_groups.group_0.weights"),
        (ct(PACKED | {"group_size": 256}), None, "config_groups.group_0.weights.group_size 256 is not supported"),
        (config(AWQ), "gptq_marlin", "--quantization gptq_marlin: --model m is quantized with awq; drop the flag"),
    ],
)
def test_what_is_not_read_is_one_line_naming_the_field(cfg, flag, said):
    with pytest.raises(UserError, match=re.escape(said)):
        detect_scheme("m", cfg, flag)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("int4u")
    src = save_tiny_llama(root / "src")
    return {
        "awq": to_awq(src, root / "awq", 32),
        "gptq": to_gptq(src, root / "gptq", root / "gptq-plain", 32, desc_act=True),
        "plain": root / "gptq-plain",
        "ct": to_pack_quantized(src, root / "ct", 64),
        "ct-sym": to_pack_quantized(src, root / "ct-sym", 32, symmetric=True),
        "ct-channel": to_pack_quantized(src, root / "ct-channel", -1),
        "gptq-v2-sym": to_gptq(src, root / "gptq-v2", root / "gptq-v2-plain", 64, False, v2=True, sym=True),
        "v2-plain": root / "gptq-v2-plain",
    }


def theirs(made: dict, scheme: str, layer: str) -> torch.Tensor:
    """The float32 weight a reading that is not ours gives the layer."""
    if scheme.startswith("gptq"):
        twin = made["plain" if scheme == "gptq" else "v2-plain"]
        return load_file(twin / "model.safetensors")[layer + ".weight"]
    state = load_file(made[scheme] / "model.safetensors")
    if scheme == "awq":  # compressed-tensors' converter (vLLM's) into its format, then its own unpacking
        t = AutoAWQConverter(group_size=32).process({k: v for k, v in state.items() if k.startswith(layer)})
        shape = t[layer + ".weight_shape"].tolist()
        q = unpack_from_int32(t[layer + ".weight_packed"], 4, shape).float()
        scale = t[layer + ".weight_scale"].float()
        zero = unpack_from_int32(t[layer + ".weight_zero_point"], 4, scale.shape, packed_dim=0).float()
        return (q - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    hf = AutoModelForCausalLM.from_pretrained(
        made[scheme], dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    return hf.get_parameter(layer + ".weight").detach()


@pytest.mark.parametrize("scheme", ["awq", "gptq", "gptq-v2-sym", "ct", "ct-sym", "ct-channel"])
def test_each_layout_unpacks_to_the_weights_its_own_library_reads(made, scheme):
    layer = "model.layers.1.mlp.down_proj"
    state = load_file(made[scheme] / "model.safetensors")
    fmt = detect_scheme(made[scheme], load_hf_config(made[scheme])).int4
    suffixes = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point")
    codes, scales, zeros, g_idx = unpack(fmt, {s: state[f"{layer}.{s}"] for s in suffixes if f"{layer}.{s}" in state})
    group = codes.shape[1] if fmt.group == -1 else fmt.group
    if g_idx.numel():  # act-order: each input's own group
        mine = (codes.float() - zeros[:, g_idx]) * scales[:, g_idx]
    else:
        mine = dequantize(codes, scales, (8 - zeros) * scales, group)
    want = theirs(made, scheme, layer)
    assert torch.allclose(mine, want, rtol=1e-3, atol=1e-6)  # compressed-tensors multiplies in the scales' float16
    model = load_model(made[scheme], load_hf_config(made[scheme]), torch.float32, "cpu")
    x = torch.randn(3, 128)
    got = model.get_submodule(layer)(x)
    assert torch.allclose(got, x @ want.t(), rtol=2e-2, atol=2e-2)  # the kernel's bfloat16


@pytest.mark.parametrize("scheme", ["awq", "gptq", "ct-sym", "ct-channel"])
def test_a_tp_rank_holds_its_slice_of_the_whole_layer(made, scheme):
    """Column-parallel rows and row-parallel columns (GPTQ with act-order: column-parallel layers only)."""
    whole = load_model(made[scheme], load_hf_config(made[scheme]), torch.float32, "cpu")
    layers = {"self_attn.k_proj": 0, "mlp.up_proj": 0} | ({} if scheme == "gptq" else {"mlp.down_proj": 1})
    for rank in (0, 1):
        tp = TensorParallel(rank=rank, size=2)
        if scheme == "gptq":
            with pytest.raises(UserError, match=r"o_proj: desc_act \(act-order\) .* --tp-size 2 splits its inputs"):
                load_model(made[scheme], load_hf_config(made[scheme]), torch.float32, "cpu", tp)
            mine = None
            continue
        mine = load_model(made[scheme], load_hf_config(made[scheme]), torch.float32, "cpu", tp)
        for name, dim in layers.items():
            full = whole.get_submodule(f"model.layers.0.{name}").dense_weight(torch.float32)
            part = mine.get_submodule(f"model.layers.0.{name}").dense_weight(torch.float32)
            n = full.shape[dim] // 2
            assert torch.equal(part, full.narrow(dim, rank * n, n)), (scheme, name, rank)


def edit(model_dir, change) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "scheme, change, said",
    [
        (
            "awq",
            lambda s: s.pop("model.layers.0.mlp.up_proj.qzeros"),
            "model.layers.0.mlp.up_proj.qzeros is missing; a awq int4 group 32, zero points layer needs qweight, "
            "qzeros, scales",
        ),
        (
            "awq",
            lambda s: s.update({"model.layers.1.mlp.down_proj.scales": torch.ones(2, 64, dtype=torch.float16)}),
            r"model.layers.1.mlp.down_proj.scales: shape [2, 64] F16, but the weight [64, 128] in awq int4 group 32, "
            r"zero points needs F16/BF16/F32 [4, 64]",
        ),
        (
            "ct",
            lambda s: s.pop("model.layers.0.self_attn.o_proj.weight_scale"),
            "model.layers.0.self_attn.o_proj.weight_scale is missing",
        ),
        (
            "ct",
            lambda s: s.update({"model.embed_tokens.weight_packed": torch.zeros(512, 8, dtype=torch.int32)}),
            "model.embed_tokens.weight_packed: a quantized tensor outside the linear layers compressed-tensors",
        ),
    ],
)
def test_a_missing_misshaped_or_misplaced_tensor_is_named_before_any_weight_is_read(
    made, tmp_path, scheme, change, said
):
    target = tmp_path / scheme
    target.mkdir()
    for f in made[scheme].iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    edit(target, change)
    with pytest.raises(UserError, match=re.escape(said)):
        load_model(target, load_hf_config(target), torch.float32, "cpu")


def test_a_split_inside_a_group_names_the_layer_and_the_tp_size(made):
    """Group 64 at TP 2: o_proj's 64 inputs split into 32 and 32, inside one group."""
    with pytest.raises(UserError) as e:
        load_model(made["ct"], load_hf_config(made["ct"]), torch.float32, "cpu", TensorParallel(rank=0, size=2))
    assert str(e.value) == (
        "model.layers.0.self_attn.o_proj.weight_scale: --tp-size 2 gives a rank its inputs [0, 32), which cuts a "
        "group of 64; use a --tp-size that splits the layer's 64 inputs on whole groups"
    )


def test_a_pd_pair_of_different_int4_schemes_is_refused_naming_both():
    awq, gptq = (describe_weights(detect_scheme("m", config(qc))) for qc in (AWQ, GPTQ))
    base = {"model_id": "x", "attention": "mha"}
    said = layout_mismatch(base | {"weights": awq}, base | {"weights": gptq})
    assert "weights: decode has 'awq int4 group 128, zero points', prefill has 'gptq int4 group 64, symmetric, " in said
    assert layout_mismatch(base | {"weights": awq}, base | {"weights": awq}) is None


@pytest.mark.parametrize("ep", [False, True])
def test_moe_experts_load_in_4_bits_whole_or_as_an_ep_ranks_experts(tmp_path, ep):
    """A Qwen3-MoE in GPTQ: every expert (the router gate stays float) equals its dequantized twin."""
    src = save_family(tmp_path / "src", "qwen3_moe")
    path = to_gptq(src, tmp_path / "gptq", tmp_path / "plain", 32, desc_act=False)
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    tp = TensorParallel(rank=1, size=2, ep=True) if ep else TensorParallel()
    model = load_model(path, load_hf_config(path), torch.float32, "cpu", tp)
    experts = {n: m for n, m in model.named_modules() if ".experts." in n and getattr(m, "quant", None)}
    assert experts and all(m.weight.dtype == torch.uint8 for m in experts.values())
    for name, m in experts.items():
        want = plain[name + ".weight"]
        assert torch.allclose(m.dense_weight(torch.float32), want, rtol=1e-2, atol=4e-3 * want.abs().max()), name
    assert model.get_submodule("model.layers.0.mlp.gate").weight.dtype == torch.float32


def test_a_qwen2_gptq_keeps_its_float_qkv_biases_beside_4_bit_weights(tmp_path):
    save_tiny(tmp_path / "src", "qwen2", {})
    path = to_gptq(tmp_path / "src", tmp_path / "gptq", tmp_path / "plain", 64, desc_act=False)
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    x = torch.randn(3, 64)
    for name in ("q_proj", "k_proj", "v_proj"):
        prefix = f"model.layers.0.self_attn.{name}"
        want = torch.nn.functional.linear(x, plain[prefix + ".weight"], plain[prefix + ".bias"])
        assert torch.allclose(model.get_submodule(prefix)(x), want, rtol=2e-2, atol=2e-2 * want.abs().max()), name

"""Quantized checkpoints: which scheme a checkpoint uses (common.quant.scheme), the linear method that
runs a quantized weight behind the parallel linear layers (common.quant.fp8_block), and the loader's
step that gives each quantized layer its FP8 weight and scales before any byte is read
(common.quant.prepare)."""

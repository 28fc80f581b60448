"""NEXTN's draft: DeepSeek's multi-token-prediction (MTP) layer, read from the target's own checkpoint.

DeepSeek-V3 keeps it as `model.layers.{num_hidden_layers}` (config `num_nextn_predict_layers`): `enorm`,
`hnorm`, `eh_proj`, one decoder layer of the target's kind, and `shared_head.norm` (its `embed_tokens` and
`shared_head.head` are the target's own, which it uses, as SGLang's deepseek_nextn.py does). For the
target's hidden state h_i at position i (after the final norm) and the token t_{i+1} that followed it:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))  ->  decoder layer at position i  ->  shared_head.norm

and the target's LM head over that gives the guess for t_{i+2}; the normed output is the next step's h.
The decoder layer's KV is one more layer of the target's pages (layer id num_hidden_layers, the id the
checkpoint gives it): the same shape, so the pool needs nothing else.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch
from common.model.draft_head import DraftHead
from common.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from common.model.loader import materialize
from common.model.weights import fill_from_shard, read_header
from common.quant.scheme import quantization_config
from common.wire.user_error import UserError


class MTPLayer(DraftHead):
    method, source = "NEXTN", "mtp"

    def __init__(self, config: PretrainedConfig, layer_class: type[nn.Module]):
        h, eps = config.hidden_size, config.rms_norm_eps
        super().__init__(h)
        self.enorm, self.hnorm, self.head_norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.decoder = layer_class(config, config.num_hidden_layers)

    def checkpoint_names(self, layer: int) -> dict[str, str]:
        """Parameter name -> the checkpoint's."""
        rename = {"head_norm.weight": "shared_head.norm.weight"}
        return {
            n: f"model.layers.{layer}." + rename.get(n, n.removeprefix("decoder.")) for n, _ in self.named_parameters()
        }

    def forward(
        self, target: LlamaForCausalLM, batch: ForwardBatch, attn: AttentionBackend, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The MTP hidden state of every row: token batch.input_ids[j] after the target's `hidden[j]`."""
        x = target.model.embed_tokens(batch.input_ids)
        x = self.eh_proj(torch.cat((self.enorm(x), self.hnorm(hidden.to(x.dtype))), dim=-1))
        x = self.decoder(x, target.model.rotary_emb(batch, x.dtype), attn, batch)
        return self.head_norm(x)

    def draft_tokens(self, target: LlamaForCausalLM, out: torch.Tensor) -> torch.Tensor:
        """The guesses from the MTP's output: the target's own LM head (DeepSeek shares it)."""
        return target.lm_head(out).float().argmax(dim=-1)

    def describe(self) -> str:
        return f"NEXTN (the checkpoint's MTP layer, layer {self.decoder.self_attn.layer_id})"


def check_nextn(hf: PretrainedConfig, model_dir: Path) -> None:
    """Refused before anything loads: the checkpoint must hold an MTP layer, unquantized."""
    if not getattr(hf, "num_nextn_predict_layers", 0):
        raise UserError(
            f"--speculative-algorithm NEXTN: {model_dir} has no multi-token-prediction layer "
            "(config num_nextn_predict_layers is 0 or absent): use a DeepSeek-V3 checkpoint that keeps it, or NGRAM"
        )
    qc = quantization_config(hf)
    if qc is not None:
        raise UserError(
            f"--speculative-algorithm NEXTN: {model_dir} is quantized ({qc.get('quant_method')}) and Tandem reads "
            "no quantized MTP layer yet; use NGRAM, or STANDALONE with a draft model"
        )


def load_mtp(model_dir: Path, hf: PretrainedConfig, target: LlamaForCausalLM, dtype: torch.dtype, device: str):
    """The first MTP layer (DeepSeek-V3 ships one), its weights read from the target's shards."""
    check_nextn(hf, model_dir)
    with torch.device("meta"):
        mtp = MTPLayer(hf, target.layer_class)
    materialize(mtp, dtype, device)
    for module in mtp.modules():
        if isinstance(module, (Attention, MLP)):
            module.fuse(filled=False)
    params = {mtp.checkpoint_names(hf.num_hidden_layers)[n]: p for n, p in mtp.named_parameters()}
    found: set[str] = set()
    for shard in sorted(model_dir.glob("*.safetensors")):
        header = read_header(shard)[0]
        names = [n for n in header if n in params]
        wrong = [n for n in names if list(header[n]["shape"]) != list(params[n].shape)]
        if wrong:
            raise UserError(f"--speculative-algorithm NEXTN: {shard}: the MTP layer's {wrong[:4]} have other shapes")
        fill_from_shard(shard, names, params)
        found.update(names)
    missing = sorted(set(params) - found)
    if missing:
        raise UserError(f"--speculative-algorithm NEXTN: {model_dir} lacks the MTP layer's weights {missing[:4]}")
    mtp.model_dir = model_dir
    return mtp.eval()

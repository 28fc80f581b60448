"""EAGLE3's draft: a head over three of the target's layers, read from its own directory
(`--speculative-draft-model-path`; SGLang's llama_eagle3.py, architecture LlamaForCausalLMEagle3).

The target's forward keeps the residual stream at the input of three of its L layers (SGLang's
layers_to_capture): [2, L // 2, L - 3], or one past each of the head config's
`eagle_config.eagle_aux_hidden_state_layer_ids` (those layers' outputs), in layer order. For position i,
a = cat of the three (3H) and the token t_{i+1} that followed it:

    x   = fc(a)                     3H -> H; on a next draft step x is the head's own output (H), as is
    y   = x + attn(cat(input_layernorm(embed(t_{i+1})), hidden_norm(x)))      q, k, v over 2H features
    out = y + mlp(post_attention_layernorm(y))          the next step's hidden state (before the norm)

and lm_head(norm(out)) over the draft vocabulary (`draft_vocab_size`) guesses t_{i+2}: draft id d is
target id d + d2t[d]. The embedding is the target's (SGLang shares it whatever the checkpoint holds); the
LM head is the head's own, or the target's when the checkpoint has none. Checkpoint names: `midlayer.*`,
`fc.weight` (and `fc.bias`), `norm.weight`, `lm_head.weight`, `d2t` (integer), with or without `model.`;
`t2d` and `embed_tokens.weight` are read past. The midlayer's KV is one more layer of the target's pages
(layer id num_hidden_layers of the target), so its attention must have the target's shape.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from common.attention.base import AttentionBackend
from common.core.forward_batch import ForwardBatch
from common.model.draft_head import DraftHead
from common.model.eagle import FLAG, eagle_config, head_shards, load_head
from common.model.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from common.model.rotary import RotaryEmbedding
from common.model.weights import read_header
from common.parallel.layers import ColumnParallelLinear, ParallelLMHead
from common.wire.user_error import UserError

READ_PAST = ("t2d", "embed_tokens.weight")  # tensors the head does not use
INT_DTYPES = {"I64": torch.int64, "I32": torch.int32}


class Eagle3Layer(DecoderLayer):
    """The head's decoder layer (SGLang's midlayer): attention over cat(normed embedding, normed hidden)."""

    def __init__(self, config: PretrainedConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        """q, k and v read 2H features, without bias (as SGLang builds them)."""
        attn = Attention(config, layer_id)
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = getattr(attn, name).out_features
            setattr(attn, name, ColumnParallelLinear(2 * config.hidden_size, rows, False))
        return attn

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin: tuple, attn: AttentionBackend, batch: ForwardBatch
    ) -> torch.Tensor:
        """The layer's output (before the head's norm): `hidden` (H) is also its residual."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        y = hidden + self.self_attn(x, cos_sin, attn, batch)
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Head(DraftHead):
    method = "EAGLE3"

    def __init__(self, config: PretrainedConfig, layer_id: int, capture: tuple[int, ...], present: set[str]):
        """`capture`: the target layers whose inputs it reads; `present`: the parameter names the checkpoint
        holds (fc.bias and lm_head are optional)."""
        h = config.hidden_size
        super().__init__(len(capture) * h)
        self.capture = capture
        self.fc = nn.Linear(self.hidden_in, h, bias="fc.bias" in present)
        self.midlayer = Eagle3Layer(config, layer_id)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.lm_head = ParallelLMHead(draft_vocab_size(config), h) if "lm_head.weight" in present else None
        self.d2t: torch.Tensor | None = None  # draft id -> target id minus draft id (None: the same ids)

    def forward(
        self, target: LlamaForCausalLM, batch: ForwardBatch, attn: AttentionBackend, hidden: torch.Tensor
    ) -> torch.Tensor:
        embeds = target.model.embed_tokens(batch.input_ids)
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's three hidden states, not the head's own output
            hidden = self.fc(hidden)
        return self.midlayer(embeds, hidden, self.rotary_emb(batch, embeds.dtype), attn, batch)

    def draft_tokens(self, target: LlamaForCausalLM, out: torch.Tensor) -> torch.Tensor:
        lm_head = self.lm_head if self.lm_head is not None else target.lm_head
        ids = lm_head(self.norm(out)).float().argmax(dim=-1)
        return ids if self.d2t is None else ids + self.d2t[ids]


def draft_vocab_size(config: PretrainedConfig) -> int:
    return getattr(config, "draft_vocab_size", None) or config.vocab_size


def capture_layers(head_hf: PretrainedConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads, in layer order, as SGLang picks them."""
    ids = (getattr(head_hf, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(sorted({i + 1 for i in ids} if ids else {2, num_layers // 2, num_layers - 3}))


def eagle3_param_name(name: str) -> str | None:
    """The head's parameter a checkpoint tensor fills (the name with or without `model.`); None: d2t (read
    apart), t2d and embed_tokens (unused)."""
    name = name.removeprefix("model.")
    return None if name == "d2t" or name in READ_PAST else name


def eagle3_config(path: str, hf: PretrainedConfig) -> tuple[Path, PretrainedConfig]:
    """The head's directory and config, refused before anything loads when its shape is not the target's,
    the layers it reads are not three of the target's, or its draft vocabulary is larger than the target's."""
    head_dir, head_hf = eagle_config(path, hf, "EAGLE3")
    layers, n = capture_layers(head_hf, hf.num_hidden_layers), hf.num_hidden_layers
    if len(layers) != 3 or not all(0 <= i < n for i in layers):
        raise UserError(
            f"{FLAG} {path}: the EAGLE3 head reads the inputs of the target's layers {list(layers)}, not three of "
            f"its {n} layers: give eagle_config.eagle_aux_hidden_state_layer_ids (three of 0..{n - 2}) in its config"
        )
    if draft_vocab_size(head_hf) > hf.vocab_size:
        raise UserError(
            f"{FLAG} {path}: the EAGLE3 head's draft vocabulary ({draft_vocab_size(head_hf)}) is larger than the "
            f"target's ({hf.vocab_size}): give the head trained for this target"
        )
    return head_dir, head_hf


def load_eagle3_head(
    found: tuple[Path, PretrainedConfig], target: LlamaForCausalLM, dtype: torch.dtype, device: str
) -> Eagle3Head:
    """The head, its weights read from its directory's shards, its KV the pool's layer after the target's."""
    n = target.config.num_hidden_layers

    def build(head_hf: PretrainedConfig, layer_id: int, present: set[str]) -> Eagle3Head:
        return Eagle3Head(head_hf, layer_id, capture_layers(head_hf, n), present)

    head = load_head(found, target, build, eagle3_param_name, dtype, device)
    head.d2t = read_d2t(head_shards(found[0]), head, target.config.vocab_size, device)
    return head


def read_d2t(shards: dict[Path, dict], head: Eagle3Head, vocab: int, device: str) -> torch.Tensor | None:
    """The draft-to-target offsets, checked: one per draft id, each landing in the target's vocabulary.
    Needed when the draft vocabulary is smaller than the target's; refused when it is missing then."""
    draft_vocab = head.lm_head.vocab if head.lm_head is not None else vocab
    found = [(shard, n) for shard, header in shards.items() for n in header if n.removeprefix("model.") == "d2t"]
    if not found:
        if draft_vocab != vocab:
            raise UserError(
                f"{FLAG} {head.model_dir}: the EAGLE3 head's draft vocabulary ({draft_vocab}) is not the target's "
                f"({vocab}) and it has no d2t tensor mapping draft ids to target ids"
            )
        return None
    d2t = read_int_tensor(*found[0])
    targets = d2t + torch.arange(draft_vocab) if d2t.shape == (draft_vocab,) else None
    if targets is None or int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise UserError(
            f"{FLAG} {head.model_dir}: the EAGLE3 head's d2t ({list(d2t.shape)}) does not map its {draft_vocab} "
            f"draft ids into the target's vocabulary of {vocab}"
        )
    return d2t.to(device)


def read_int_tensor(shard: Path, name: str) -> torch.Tensor:
    """One integer tensor of a shard (the weights' reader, common/model/weights.py, takes floats)."""
    header, data_start = read_header(shard)
    entry = header[name]
    if entry["dtype"] not in INT_DTYPES:
        raise UserError(f"{FLAG} {shard}: {name} is {entry['dtype']}, not an integer tensor")
    start, stop = entry["data_offsets"]
    with open(shard, "rb") as fh:
        fh.seek(data_start + start)
        raw = bytearray(fh.read(stop - start))
    return torch.frombuffer(raw, dtype=INT_DTYPES[entry["dtype"]]).reshape(entry["shape"]).long()

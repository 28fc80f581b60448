"""What the head drafter (common/engine/spec/head_drafter.py) asks of a draft head: NEXTN's MTP layer
(common/model/nextn.py), an EAGLE head (common/model/eagle.py) or an EAGLE3 head (common/model/eagle3.py).

Each reads, for position i, the target's hidden state(s) there and the token t_{i+1} that followed, writes
its KV as one more layer of the target's pages, and guesses t_{i+2}; its output is the next draft step's
hidden state. The head says which of the target's hidden states it reads (`capture`, `hidden_in`: what
the aux record carries across PD), and names itself for the KV layout, so a PD peer with another head is
refused before any KV moves.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from common.model.identity import model_identity


class DraftHead(nn.Module):
    """A subclass defines forward(target, batch, attn, hidden): the head's output of every row, token
    batch.input_ids[j] after hidden[j] (the target's, or on a next draft step the head's own output); and
    draft_tokens(target, out): the greedy guess of each output row, in the target's vocabulary."""

    method = ""  # --speculative-algorithm's name of it
    source = "head"  # the KV layout's key of the weights' identity ("mtp": the target's own MTP layer)
    capture: tuple[int, ...] = ()  # the target layers whose inputs it reads, in order; (): the final hidden state

    def __init__(self, hidden_in: int):
        """`hidden_in`: the width of the target's hidden state it reads per position (float32 in the aux record)."""
        super().__init__()
        self.hidden_in = hidden_in
        self.model_dir: Path | None = None  # set by its loader: the identity a PD peer must match

    def speculative_descriptor(self) -> str:
        """The KV layout's `speculative` field: the method, the weights' identity and the aux record's hidden state."""
        ident = model_identity(self.model_dir)
        return f"{self.method} {self.source}={ident} layers=1 hidden={self.hidden_in}xfloat32"

    def describe(self) -> str:
        return f"{self.method} head {self.model_dir}"

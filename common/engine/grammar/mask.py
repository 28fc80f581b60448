"""The batch's token bitmask: each constrained row's allowed tokens, filled on the host by its matcher
and applied to the logits (xgrammar's kernels: its CPU kernel, or its CUDA kernel on the device) after
bias, min_tokens and penalties, so a grammar has the last word. Rows that are not constrained this step
(no grammar, thinking, grammar complete) are left alone."""

from __future__ import annotations

import torch
import xgrammar as xgr

from common.engine.grammar.req_grammar import ReqGrammar


class GrammarMask:
    def __init__(self, grammars: list[ReqGrammar | None], outputs: list[list[int]], device):
        self.grammars, self.outputs = grammars, outputs
        self.rows = [i for i, g in enumerate(grammars) if g is not None]
        self.vocab_size = vocab_size = grammars[self.rows[0]].vocab_size
        self.bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
        if torch.device(device).type == "cuda":
            self.bitmask = self.bitmask.pin_memory()
        self.device = device

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with every token the row's grammar forbids at -inf (in place when they are float32)."""
        rows = [i for i in self.rows if self.grammars[i].applies()]
        if not rows:
            return logits
        for i in rows:
            try:
                self.grammars[i].fill(self.bitmask, i, self.outputs[i])
            except Exception:  # the row's commit raises it again and ends that request alone
                self.bitmask[i].fill_(-1)
        bitmask = self.bitmask
        if logits.device.type == "cuda":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        if logits.shape[-1] > self.vocab_size:  # padding past the tokenizer's vocabulary is never allowed
            logits[rows, self.vocab_size :] = float("-inf")
        return logits

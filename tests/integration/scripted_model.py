"""A tiny Llama that writes one fixed answer, for the tests of what only a real model's text exercises:
tool calls in its own format (tool_choice auto), reasoning split from the answer, a grammar applied once
the thinking ends.

Each layer's attention and MLP write nothing (o_proj and down_proj are zero), so the next token depends on
the last token alone: the embedding of the script's i-th token is the i-th basis vector and the LM head maps
it to the (i+1)-th token. The script starts after the chat template's last token ("\\n") and ends with EOS;
its tokens must all differ (asserted). A token off the script has all logits equal: greedy then takes the
lowest id the request allows (under a grammar: the grammar's first allowed token).

The tokenizer is the built-in model's plus `<think>`, `</think>`, `<tool_call>`, `</tool_call>` as added
tokens, with a chat template that lists the tools in the system turn (Hermes style, as Qwen's does).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

THINKING = "I should check the weather."
CALL = {"name": "get_time", "arguments": {}}  # one with arguments repeats tokens (such as '":')
SCRIPT = f"<think>{THINKING}</think><tool_call>{json.dumps(CALL, separators=(',', ':'))}</tool_call>"
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = 2  # <|im_end|>


def script_ids(tok) -> list[int]:
    """The chain: the template's last token, the script's tokens, EOS."""
    ids = [tok.encode("\n")[0], *tok.encode(SCRIPT, add_special_tokens=False), EOS]
    assert len(set(ids)) == len(ids), [tok.convert_ids_to_tokens(i) for i in ids]
    return ids


def save_scripted_model(path: Path, builtin_dir: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(builtin_dir)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE
    chain = script_ids(tok)
    hidden = 64
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=len(tok),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=EOS,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, i] = 10.0
            model.lm_head.weight[following, i] = 50.0
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=EOS).save_pretrained(path)
    tok.save_pretrained(path)
    return path

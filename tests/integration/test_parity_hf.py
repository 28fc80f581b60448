"""Greedy token ids of the monolithic server over HTTP, the prompts decoded together as one batch, equal Hugging
Face transformers' generate (one prompt at a time)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 24
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years, "
    "presses operated in more than two hundred cities across Europe, and millions of books circulated. "
    "Scholars argue about the consequences: literacy rose, scientific results spread faster, religious "
    "reform found an audience, and vernacular languages gained status against Latin. "
) * 4


def prompts(tok) -> list[list[int]]:
    chats = [
        "What is the capital of France?",
        "Write a haiku about autumn leaves.",
        "Explain in two sentences why the sky is blue.",
        "Summarise this text in one sentence:\n" + LONG_TEXT,
    ]
    raws = [
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "1, 2, 3, 4, 5,",
        LONG_TEXT + "In conclusion,",
    ]
    chat_ids = [
        list(
            tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for c in chats
    ]
    return chat_ids + [tok.encode(r) for r in raws]


@pytest.fixture(scope="module")
def expected(builtin_model_dir):
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    model = AutoModelForCausalLM.from_pretrained(builtin_model_dir, dtype=torch.float32).eval()
    cases = []
    for ids in prompts(tok):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        cases.append((ids, out[0, len(ids) :].tolist()))
    assert max(len(ids) for ids, _ in cases) > 300
    return cases


def generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "flags",
    [["--page-size", "16", "--chunked-prefill-size", "64"], ["--page-size", "1", "--chunked-prefill-size", "0"]],
    ids=["page16-chunked64", "page1-unchunked"],
)
def test_greedy_output_equals_transformers(expected, flags, reference_servers):
    server = reference_servers.get("--model", "builtin", *flags)  # the full model, not tests/served_model.py's
    with concurrent.futures.ThreadPoolExecutor(len(expected)) as pool:  # decoded as one batch
        answers = list(pool.map(lambda case: generate(server.url, case[0]), expected))
    for (ids, want), got in zip(expected, answers):
        assert got["output_ids"] == want, f"prompt of {len(ids)} tokens diverged"
    # a radix hit: the long prompt again reuses cached pages and still matches exactly
    ids, want = expected[3]
    again = generate(server.url, ids)
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 16
    assert again["output_ids"] == want
    server.wait_idle()

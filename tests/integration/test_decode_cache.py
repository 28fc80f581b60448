"""The decode's prefix cache in a real PD pair (router -> prefill -> Mooncake -> decode, tiny Llama):
a conversation of 4 turns, each prompt the last one's prompt, its answer and new tokens. With the decode's
radix cache on, from turn 2 the prefill sends exactly the pages the decode lacks (at most the new tokens
plus one page), counted by its `bytes_sent`; with it off (a second decode with --disable-radix-cache,
behind its own router), the whole prompt. Greedy tokens equal transformers' either way, both sides'
hits are reported in meta and usage, and every pool is idle and intact afterwards."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.core.page_meta import pages_for
from tests.conftest import metric, start_server
from tests.integration.cluster import generate, start_cluster, start_router
from tests.integration.test_metrics import bytes_per_page
from tests.integration.tiny_model import hf_greedy, random_prompts

PAGE = 16
FIRST, NEW, ANSWER, TURNS = 40, 20, 12, 4


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """One prefill, a decode with its cache (router `on`) and one without (router `off`)."""
    pytest.importorskip("mooncake.engine")
    flags = ("--model", str(tiny_model_dir), "--page-size", str(PAGE), "--chunked-prefill-size", "64")
    plain_flags = ("--disaggregation-mode", "decode", "--transfer-backend", "mooncake", "--disable-radix-cache", *flags)
    plain = start_server(*plain_flags, name="decode-nc")
    c = routers = None
    try:
        c = start_cluster("mooncake", flags=flags)  # starts while `plain` does
        plain.wait_ready()
        routers = {"on": c.router, "off": start_router([(c.prefills[0], c.prefill_bootstrap_ports[0])], [plain])}
        yield c, plain, routers
    finally:
        if routers is not None:
            routers["off"].stop()
        plain.stop()
        if c is not None:
            c.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def bytes_sent(c) -> float:
    return metric(c.prefills[0].url, "tandem_kv_transfer_events_total", event="bytes_sent")


@pytest.mark.parametrize("cache", ["on", "off"])
def test_each_turn_sends_only_what_the_decode_lacks_and_tokens_equal_transformers(pair, hf, cache):
    c, plain, routers = pair
    page_bytes = bytes_per_page(c)
    [prompt] = random_prompts(1, FIRST, FIRST, seed=21 if cache == "on" else 22)
    news = random_prompts(TURNS - 1, NEW, NEW, seed=23 if cache == "on" else 24)
    history: list[int] | None = None  # the last turn's prompt and answer
    for turn in range(1, TURNS + 1):
        if history is not None:
            prompt = history + news[turn - 2]
        before = bytes_sent(c)
        out = generate(routers[cache].url, prompt, ANSWER, sampling={"ignore_eos": True})
        assert out["output_ids"] == hf_greedy(hf, [prompt], ANSWER)[0], f"turn {turn} diverged"
        cached = 0 if history is None or cache == "off" else (len(history) - 1) // PAGE * PAGE
        meta = out["meta_info"]
        assert meta["decode_cached_tokens"] == cached, turn
        assert meta["prefill_cached_tokens"] == meta["cached_tokens"]
        pages = pages_for(len(prompt), PAGE) - cached // PAGE
        assert bytes_sent(c) - before == pages * page_bytes, f"turn {turn}: bytes sent"
        if cache == "on" and history is not None:
            assert pages <= pages_for(NEW, PAGE) + 1  # the new tokens plus one page at most
        history = prompt + out["output_ids"]
    c.wait_idle()
    plain.wait_idle()


def test_usage_reports_both_sides_cached_tokens(pair):
    c, _, routers = pair
    [prompt] = random_prompts(1, 50, 50, seed=25)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = httpx.post(routers["on"].url + "/v1/completions", json=body, timeout=120).json()
    details = first["usage"]["prompt_tokens_details"]
    assert details["decode_cached_tokens"] == 0 and details["cached_tokens"] == details["prefill_cached_tokens"]
    answer_ids = generate(routers["on"].url, prompt, 4, sampling={"ignore_eos": True})["output_ids"]
    again = httpx.post(
        routers["on"].url + "/v1/completions", json=body | {"prompt": prompt + answer_ids + [7, 8]}, timeout=120
    ).json()
    details = again["usage"]["prompt_tokens_details"]
    assert details["decode_cached_tokens"] == (50 + 4 - 1) // PAGE * PAGE == 48
    assert details["prefill_cached_tokens"] == details["cached_tokens"] == 48
    c.wait_idle()

"""Speculative decoding as a user runs it, over HTTP and across PD (Mooncake):

- the built-in SmolLM2 with NGRAM: a monolithic server and a PD pair (a plain prefill, an NGRAM decode) give
  the reference server's greedy tokens and logprobs on code, lists and chat; the PD pair accepts as many
  drafts as the monolithic server (within 2%), and both count them in meta_info and /metrics;
- a tiny Llama with a STANDALONE draft (its first two layers) on both PD sides: the draft's KV for the prompt
  travels in the target's pages, tokens equal transformers', drafts accepted as in one engine;
- a tiny DeepSeek-V3 with NEXTN (its MTP layer) on both PD sides: the MTP's KV of the prompt travels in the
  pages and the prompt's last hidden state in the aux record; tokens and accepted drafts equal one engine's;
- tiny Llamas with an EAGLE and an EAGLE3 head on both PD sides: the head's KV of the prompt travels in the
  pages, and in the aux record the prompt's last hidden state (EAGLE) or the inputs of the target's three
  captured layers there (EAGLE3: three hidden states wide); tokens and logprobs equal decoding without
  speculation, verifies and accepted drafts one engine's;
- a decode without the draft refuses that prefill before any KV moves, naming both sides' `speculative`;
- NGRAM at --tp-size 2: the verify forward runs on both ranks, tokens equal transformers'.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
from tests.conftest import metric, start_server
from tests.integration.cluster import generate, spawn_cluster, start_router
from tests.integration.spec_models import (
    save_deepseek_mtp,
    save_eagle3_target_and_head,
    save_eagle_target_and_head,
    save_target_and_draft,
)
from tests.integration.tiny_model import hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(900)  # three servers of the built-in model (and the shared reference) start first
BUILTIN = ("--page-size", "16", "--chunked-prefill-size", "64")  # test_pd.py's reference server
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6")
TINY_NEW = 24
NEXTN_FLAGS = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target, draft = save_target_and_draft(tmp_path_factory.mktemp("spec-pd"))
    flags = ("--model", str(target), "--page-size", "4", "--chunked-prefill-size", "32")
    standalone = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft))
    return target, draft, flags, (*standalone, "--speculative-num-steps", "3")


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    model = save_deepseek_mtp(tmp_path_factory.mktemp("mtp-pd"))
    return model, ("--model", str(model), "--page-size", "4", "--chunked-prefill-size", "16", *NEXTN_FLAGS)


HEADS = {"EAGLE": save_eagle_target_and_head, "EAGLE3": save_eagle3_target_and_head}


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, tuple]:
    """Each head algorithm's tiny target, its head, and the flags that serve them."""
    out = {}
    for algo, save in HEADS.items():
        target, head = save(tmp_path_factory.mktemp(f"{algo.lower()}-pd"))
        speculative = ("--speculative-algorithm", algo, "--speculative-draft-model-path", str(head))
        flags = ("--model", str(target), "--page-size", "4", "--chunked-prefill-size", "16", *speculative)
        out[algo] = target, head, (*flags, "--speculative-num-steps", "3")
    return out


@pytest.fixture(scope="module")
def servers(tiny, mtp, heads, reference_servers):
    """Started at once: the NGRAM monolithic server, the built-in PD pair, the tiny STANDALONE, NEXTN, EAGLE and
    EAGLE3 PD pairs, a tiny decode without a draft (behind its own router, with the STANDALONE prefill) and NGRAM at
    TP 2."""
    _, _, flags, standalone = tiny
    started = []
    try:
        mono = start_server(*BUILTIN, *NGRAM, name="mono-ngram")
        started.append(mono)
        ngram_pd = spawn_cluster("mooncake", flags=BUILTIN, decode_flags=NGRAM)
        started.append(ngram_pd)
        draft_pd = spawn_cluster("mooncake", flags=(*flags, *standalone))
        started.append(draft_pd)
        nextn_pd = spawn_cluster("mooncake", flags=mtp[1])
        started.append(nextn_pd)
        head_pds = {algo: spawn_cluster("mooncake", flags=flags) for algo, (_, _, flags) in heads.items()}
        started.extend(head_pds.values())
        plain = start_server(
            "--disaggregation-mode", "decode", "--transfer-backend", "mooncake", *flags, name="decode-plain"
        )
        started.append(plain)
        tp = start_server(*flags, "--tp-size", "2", *NGRAM, name="ngram-tp2")
        started.append(tp)
        for s in (mono, plain, tp):
            s.wait_ready(600)
        for cluster in (ngram_pd, draft_pd, nextn_pd, *head_pds.values()):
            cluster.wait_ready(600)
        prefill = [(draft_pd.prefills[0], draft_pd.prefill_bootstrap_ports[0])]
        mismatched = start_router(prefill, [plain], name="router-mismatch")
        started.append(mismatched)
        yield {
            "mono": mono,
            "ngram_pd": ngram_pd,
            "draft_pd": draft_pd,
            "nextn_pd": nextn_pd,
            **{f"{algo}_pd": cluster for algo, cluster in head_pds.items()},
            "plain": plain,
            "mismatched": mismatched,
            "tp": tp,
        }
    finally:
        for s in reversed(started):
            s.stop()


@pytest.fixture(scope="module")
def builtin_prompts(builtin_model_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)

    def chat(content: str) -> list[int]:
        messages = [{"role": "user", "content": content}]
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    return [
        tok.encode("def add_1(x):\n    return x + 1\n\ndef add_2(x):\n    return x + 2\n\ndef add_3(x):\n"),
        tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
        chat("List the days of the week, each on its own line, as 'Day N: name'."),
    ]


def accepted(out: dict) -> int:
    return out["meta_info"]["spec_accepted_tokens"]


def test_ngram_monolithic_and_pd_equal_the_reference_and_accept_alike(servers, reference_servers, builtin_prompts):
    ref = reference_servers.get(*BUILTIN)
    totals = {"mono": 0, "pd": 0}
    for ids in builtin_prompts:  # one request at a time on each server, the three servers at once
        with ThreadPoolExecutor(3) as pool:
            asked = [pool.submit(generate, s.url, ids, 48, return_logprob=True) for s in (ref, servers["mono"])]
            pd = generate(servers["ngram_pd"].url, ids, 48)
            want, mono = (a.result() for a in asked)
        assert mono["output_ids"] == want["output_ids"] == pd["output_ids"]
        lp = [x[0] for x in want["meta_info"]["output_token_logprobs"]]
        got = [x[0] for x in mono["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp, got)) < 1e-4
        assert mono["meta_info"]["spec_verify_ct"] > 0 and pd["meta_info"]["spec_verify_ct"] > 0
        totals["mono"] += accepted(mono)
        totals["pd"] += accepted(pd)
    assert totals["mono"] > 40  # code and lists repeat themselves
    assert abs(totals["pd"] - totals["mono"]) <= 0.02 * totals["mono"]
    decode = servers["ngram_pd"].decodes[0]
    assert metric(decode.url, "tandem_spec_accept_length_sum") == totals["pd"]
    assert metric(decode.url, "tandem_spec_accept_length_count") == metric(decode.url, "tandem_spec_verify_total") > 0
    servers["ngram_pd"].wait_idle()
    servers["mono"].wait_idle()


def test_standalone_pd_carries_the_draft_kv_and_equals_transformers(servers, tiny):
    target, draft, _, _ = tiny
    prompts = random_prompts(3, 5, 70, seed=31)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    want = hf_greedy(hf, prompts, TINY_NEW)
    engine = Engine(
        ServerConfig(
            model=str(target),
            page_size=4,
            chunked_prefill_size=32,
            max_total_tokens=4096,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(draft),
            speculative_num_steps=3,
        )
    )
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=TINY_NEW, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    for ids, expected, mono in zip(prompts, want, reqs):
        out = generate(servers["draft_pd"].url, ids, TINY_NEW, sampling={"ignore_eos": True})
        assert out["output_ids"] == expected == mono.output_ids
        assert accepted(out) == mono.spec_accepted > 0  # the draft's KV of the prompt arrived with the target's
    servers["draft_pd"].wait_idle()


def one_at_a_time(engine: Engine, prompts: list[list[int]]) -> list[Req]:
    """Greedy answers of TINY_NEW tokens with logprobs, one request at a time, as the pair serves them (in a
    batch a request's last token may come from a verify of the others' drafts, and count as one)."""
    params = SamplingParams(max_new_tokens=TINY_NEW, temperature=0, ignore_eos=True)
    reqs = [Req(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        r.return_logprob = True
        engine.scheduler.add_request(r)
        while engine.scheduler.step():
            pass
    return reqs


def test_nextn_pd_carries_the_mtp_kv_and_hidden_state_and_accepts_as_one_engine(servers, mtp):
    """Prompts of 5 to 40 tokens in chunks of 16 (the prefill's MTP runs each chunk); the decode's first draft
    comes from the aux record's hidden state and the MTP KV that crossed: the same drafts as one engine."""
    model = mtp[0]
    prompts = random_prompts(3, 5, 40, seed=35)
    config = ServerConfig(
        model=str(model), page_size=4, chunked_prefill_size=16, speculative_algorithm="NEXTN", speculative_num_steps=3
    )
    reqs = one_at_a_time(Engine(config), prompts)
    for ids, mono in zip(prompts, reqs):
        out = generate(servers["nextn_pd"].url, ids, TINY_NEW, sampling={"ignore_eos": True})
        assert out["output_ids"] == mono.output_ids
        assert out["meta_info"]["spec_verify_ct"] == mono.spec_verify_ct
        assert accepted(out) == mono.spec_accepted > 0
    servers["nextn_pd"].wait_idle()


@pytest.mark.parametrize("algo", list(HEADS))
def test_a_head_pd_carries_its_kv_and_hidden_states_and_equals_decoding_without_it(servers, heads, algo):
    """Prompts of 5 to 40 tokens in chunks of 16: the PD pair's tokens and logprobs are those of one engine
    without speculation, its verifies and accepted drafts those of one engine with the head."""
    target, head, _ = heads[algo]
    prompts = random_prompts(3, 5, 40, seed=36)
    common = {"model": str(target), "page_size": 4, "chunked_prefill_size": 16}
    base = one_at_a_time(Engine(ServerConfig(**common)), prompts)
    flags = {"speculative_algorithm": algo, "speculative_draft_model_path": str(head), "speculative_num_steps": 3}
    mono = one_at_a_time(Engine(ServerConfig(**common, **flags)), prompts)
    for ids, want, spec in zip(prompts, base, mono):
        out = generate(servers[f"{algo}_pd"].url, ids, TINY_NEW, sampling={"ignore_eos": True}, return_logprob=True)
        assert out["output_ids"] == want.output_ids == spec.output_ids
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want.output_logprobs)) < 1e-4
        assert out["meta_info"]["spec_verify_ct"] == spec.spec_verify_ct
        assert accepted(out) == spec.spec_accepted > 0
    servers[f"{algo}_pd"].wait_idle()


def test_a_decode_without_the_draft_refuses_the_prefill_naming_both(servers):
    prefill = servers["draft_pd"].prefills[0]
    sent = metric(prefill.url, "tandem_kv_transfer_events_total", event="bytes_sent")
    r = httpx.post(
        servers["mismatched"].url + "/generate",
        json={"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=120,
    )
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert "speculative: decode has 'none', prefill has 'STANDALONE draft=" in message, message
    assert "layers=2'" in message
    assert metric(prefill.url, "tandem_kv_transfer_events_total", event="bytes_sent") == sent  # no KV moved
    servers["plain"].wait_idle()
    servers["draft_pd"].wait_idle()


def test_a_constrained_request_decodes_as_without_speculation(servers, reference_servers):
    """A request under a grammar gets no drafts (its matcher sees committed tokens only): the same JSON."""
    schema = {"type": "object", "properties": {"days": {"type": "array", "items": {"type": "string"}}}}
    body = {
        "messages": [{"role": "user", "content": "List the days of the week as JSON."}],
        "max_tokens": 48,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "days", "schema": schema}},
    }
    answers = [
        httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300).json()
        for s in (reference_servers.get(*BUILTIN), servers["mono"])
    ]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    servers["mono"].wait_idle()


def test_ngram_at_tp_2_verifies_on_every_rank(servers, tiny):
    target = tiny[0]
    phrases = random_prompts(2, 6, 10, seed=33)
    prompts = random_prompts(2, 5, 40, seed=32) + [p * 4 for p in phrases]
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    verified = 0
    for ids, want in zip(prompts, hf_greedy(hf, prompts, TINY_NEW)):
        out = generate(servers["tp"].url, ids, TINY_NEW, sampling={"ignore_eos": True})
        assert out["output_ids"] == want
        verified += out["meta_info"]["spec_verify_ct"]
    assert verified > 0
    servers["tp"].wait_idle()

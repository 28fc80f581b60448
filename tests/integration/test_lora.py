"""LoRA adapters (--enable-lora) as a user serves them: three tiny random PEFT adapters made with `peft` on the
tiny random Llama (different ranks and target modules, random non-zero B), one monolithic server with two
adapter slots for the three (so one mixed batch loads them LRU), and every answer checked against `peft` on
transformers token for token; the prefix cache keeps each adapter's pages apart; the adapters' endpoints and
start-up mistakes; a fourth adapter loaded and unloaded at run time (unloaded under a running request: it
runs on to its end, then the slot is freed); two servers over one store with host tiers: the same prompt under
two adapters hits each its own pages in the host tier and, on a server numbering the adapters otherwise, in the
store; and through a 1P2D cluster, the decodes holding two of the three: the same tokens, the third refused by
the router naming it (and by the decode), a stream under an adapter moved with it when its decode is killed,
every page freed, then an adapter loaded through the router's fan-out (the prefill's refusal reported per
worker) and served."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from common.model.truncate import truncate_model
from tests.conftest import ROOT, metric, start_server
from tests.integration.cluster import start_cluster
from tests.integration.tiny_model import hf_greedy, random_prompts, save_tiny_llama

NEW_TOKENS = 12
LONG_TOKENS = 300  # a request still running when the adapter under it is unloaded
ADAPTERS = {  # name -> (rank, alpha, target modules)
    "a": (4, 8, ["q_proj", "v_proj"]),
    "b": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "c": (2, 2, ["o_proj", "gate_proj", "down_proj"]),
}


def save_adapter(base_dir: Path, path: Path, rank: int, alpha: int, modules: list[str], seed: int) -> Path:
    """A PEFT LoRA adapter of the model at base_dir, its A and B random (PEFT starts B at zero: no change)."""
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft.save_pretrained(path)
    return path


def peft_greedy(
    base_dir: Path, adapter: Path | None, prompts: list[list[int]], new_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return hf_greedy(model, prompts, new_tokens)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(root / "base")
    paths = {n: save_adapter(base, root / n, *spec, seed=i) for i, (n, spec) in enumerate(ADAPTERS.items())}
    late = save_adapter(base, root / "d", 4, 4, ["k_proj", "up_proj"], seed=7)  # loaded at run time
    return {"root": root, "base": base, "paths": paths, "late": late}


@pytest.fixture(scope="module")
def expected(made) -> dict:
    """name (None: the base model) -> peft's greedy tokens of each prompt."""
    prompts = random_prompts(4, 20, 40, seed=5)  # the last one is the cache test's alone
    out = {n: peft_greedy(made["base"], p, prompts) for n, p in [(None, None), *made["paths"].items()]}
    out["d"] = peft_greedy(made["base"], made["late"], prompts)
    for name in (*ADAPTERS, "d"):
        assert out[name] != out[None], f"adapter {name} does not change the output: the test would prove nothing"
    long = peft_greedy(made["base"], made["late"], prompts[:1], LONG_TOKENS)[0]
    return {"prompts": prompts, "tokens": out, "long": long}


@pytest.fixture(scope="module")
def server(made):
    lora_paths = [f"{n}={p}" for n, p in made["paths"].items() if n != "c"]
    lora_paths.append(json.dumps({"lora_name": "c", "lora_path": str(made["paths"]["c"]), "max_rank": 8}))
    flags = ["--page-size", "4", "--max-loras-per-batch", "2", "--served-model-name", "tiny"]
    proc = start_server("--model", str(made["base"]), "--enable-lora", "--lora-paths", *lora_paths, *flags)
    yield proc.wait_ready()
    proc.stop()


def generate(url: str, ids: list[int], adapter: str | None, logprobs: bool = False) -> dict:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": logprobs}
    if adapter is not None:
        body["lora_path"] = adapter
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_mixed_batch_of_three_adapters_and_the_base_equals_peft(server, expected):
    """Every prompt under the base and each adapter, all at once: 12 requests, 3 adapters in 2 slots."""
    cases = [(n, i) for n in (None, *ADAPTERS) for i in range(3)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: generate(server.url, expected["prompts"][c[1]], c[0]), cases))
    for (name, i), answer in zip(cases, answers):
        assert answer["output_ids"] == expected["tokens"][name][i], f"adapter {name}, prompt {i}"


def test_same_prompt_under_two_adapters_after_both_were_cached(server, expected):
    """The KV one adapter cached is never another's: each gets its own answer, and hits only its own pages."""
    ids = expected["prompts"][3]
    first = {n: generate(server.url, ids, n) for n in ("a", "b", None)}
    again = {n: generate(server.url, ids, n) for n in ("b", "a", None)}
    for n in ("a", "b", None):
        assert first[n]["meta_info"]["cached_tokens"] == 0, f"{n}'s first run hit another adapter's pages"
        assert again[n]["meta_info"]["cached_tokens"] == (len(ids) - 1) // 4 * 4, f"{n} missed its own pages"
        assert first[n]["output_ids"] == again[n]["output_ids"] == expected["tokens"][n][3], n


def test_openai_model_selects_the_adapter(server, expected):
    """vLLM's `model: NAME` and SGLang's `model: BASE:NAME` run the adapter /generate's lora_path runs."""
    ids = expected["prompts"][1]
    want = generate(server.url, ids, "c")["text"]
    for model in ("c", "tiny:c"):
        body = {"model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want and r.json()["model"] == "c"


def test_models_lists_adapters_and_an_unknown_one_is_404(server, made):
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("a", "tiny"), ("b", "tiny"), ("c", "tiny")]
    assert cards[1]["root"] == str(made["paths"]["a"])
    body = {"model": "nope", "prompt": [1, 2, 3], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "model"
    r = httpx.post(server.url + "/generate", json={"input_ids": [1, 2], "lora_path": "nope"})
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "lora_path"


def peft_masked_greedy(base_dir: Path, adapter: Path, prompt: list[int], allowed: list[int], n: int) -> list[int]:
    """peft's greedy tokens when only `allowed` may follow (what a grammar admitting exactly them leaves)."""
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(allowed[int(torch.argmax(logits[allowed]))])
    return ids[len(prompt) :]


def test_structured_output_under_an_adapter_is_peft_masked_by_the_grammar(server, made, expected):
    """A regex admitting exactly t3, t4, t5 five times, under adapter b: peft's greedy choice among them (not t2:
    the tiny model's EOS, which a grammar admits only once it is complete)."""
    prompt = expected["prompts"][1]
    want = peft_masked_greedy(made["base"], made["paths"]["b"], prompt, [3, 4, 5], 5)
    assert len(set(want)) > 1, "one token all along: the test would prove little"
    params = {"max_new_tokens": 8, "temperature": 0, "regex": "(t3|t4|t5){5}"}
    r = httpx.post(server.url + "/generate", json={"input_ids": prompt, "sampling_params": params, "lora_path": "b"})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"][:5] == want and r.json()["meta_info"]["finish_reason"]["type"] == "stop", r.text


def peft_logprobs(base_dir: Path, adapter: Path | None, prompt: list[int], tokens: list[int]) -> list[float]:
    """peft's log-probability of each of `tokens` after `prompt` and the tokens before it."""
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens].tolist()


@pytest.fixture(scope="module")
def tp_server(made):
    """The three adapters at --tp-size 2 in two slots: A and B split as their base layers on each rank."""
    lora_paths = [f"{n}={p}" for n, p in made["paths"].items()]
    flags = ["--page-size", "4", "--max-loras-per-batch", "2", "--tp-size", "2"]
    proc = start_server("--model", str(made["base"]), "--enable-lora", "--lora-paths", *lora_paths, *flags)
    yield proc.wait_ready()
    proc.stop()


def test_tp2_mixed_batch_tokens_and_logprobs_equal_peft(tp_server, made, expected):
    """Three adapters and the base at once at TP 2 (the followers copying in what rank 0's LRU slots hold)."""
    cases = [(n, i) for n in (None, *ADAPTERS) for i in range(3)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: generate(tp_server.url, expected["prompts"][c[1]], c[0], True), cases))
    paths = {None: None, **made["paths"]}
    for (name, i), answer in zip(cases, answers):
        assert answer["output_ids"] == expected["tokens"][name][i], f"adapter {name}, prompt {i}"
        got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        want = peft_logprobs(made["base"], paths[name], expected["prompts"][i], answer["output_ids"])
        assert got == pytest.approx(want, abs=1e-4), f"adapter {name}, prompt {i}"
    assert lora_info(tp_server.url)["loads"] >= 3  # 3 adapters through 2 slots


@pytest.fixture(scope="module")
def spec_server(made):
    """The three adapters under STANDALONE speculative decoding, its draft the base model cut to one layer."""
    draft = truncate_model(str(made["base"]), 1, made["root"] / "draft")
    spec = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft)]
    lora_paths = [f"{n}={p}" for n, p in made["paths"].items()]
    flags = ["--page-size", "4", "--max-loras-per-batch", "2", *spec, "--speculative-num-steps", "3"]
    proc = start_server("--model", str(made["base"]), "--enable-lora", "--lora-paths", *lora_paths, *flags)
    yield proc.wait_ready()
    proc.stop()


def test_speculative_decoding_under_adapters_equals_peft(spec_server, expected):
    """The draft proposes without the adapters, the target verifies under each request's: greedy tokens as peft's."""
    cases = [(n, i) for n in (None, *ADAPTERS) for i in range(2)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: generate(spec_server.url, expected["prompts"][c[1]], c[0]), cases))
    for (name, i), answer in zip(cases, answers):
        assert answer["output_ids"] == expected["tokens"][name][i], f"adapter {name}, prompt {i}"
    assert all(a["meta_info"]["spec_verify_ct"] > 0 for a in answers)
    assert sum(a["meta_info"]["spec_accepted_tokens"] for a in answers) > 0


def lora_info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["lora"]


def model_ids(url: str) -> list[str]:
    return [c["id"] for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]]


def test_an_adapter_loaded_at_run_time_is_served_and_listed(server, made, expected):
    """vLLM's /v1/load_lora_adapter (SGLang's body): /v1/models lists it at once, its answers equal peft's."""
    body = {"lora_name": "d", "lora_path": str(made["late"])}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["loaded_adapters"]["d"] == str(made["late"])
    assert model_ids(server.url) == ["tiny", "a", "b", "c", "d"]
    for i in range(3):
        assert generate(server.url, expected["prompts"][i], "d")["output_ids"] == expected["tokens"]["d"][i], i
    again = httpx.post(server.url + "/load_lora_adapter", json=body, timeout=60)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name", again.text
    assert "'d' is already loaded" in again.json()["error"]["message"]


def test_load_and_unload_mistakes_name_the_field(server, tmp_path):
    missing = httpx.post(server.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path", missing.text
    assert "no adapter_config.json and adapter_model.safetensors there" in missing.json()["error"]["message"]
    no_path = httpx.post(server.url + "/load_lora_adapter", json={"lora_name": "x"})
    assert no_path.status_code == 400 and no_path.json()["error"]["param"] == "lora_path", no_path.text
    unknown = httpx.post(server.url + "/unload_lora_adapter", json={"lora_name": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "lora_name", unknown.text
    assert "'nope'" in unknown.json()["error"]["message"]


def test_unloading_an_adapter_in_use_waits_for_its_last_request(server, made, expected):
    """Unloaded under a running request: no new request gets it at once, the running one ends exactly as peft's,
    then its slot is empty."""
    if "d" not in model_ids(server.url):
        httpx.post(server.url + "/load_lora_adapter", json={"lora_name": "d", "lora_path": str(made["late"])})
    params = {"max_new_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": expected["prompts"][0], "sampling_params": params, "lora_path": "d", "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=300) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        r = httpx.post(server.url + "/unload_lora_adapter", json={"lora_name": "d"}, timeout=60)
        assert r.status_code == 200 and "d" not in r.json()["loaded_adapters"], r.text
        assert model_ids(server.url) == ["tiny", "a", "b", "c"]
        assert lora_info(server.url)["unloading"] == ["d"]
        refused = httpx.post(server.url + "/generate", json={"input_ids": [1, 2], "lora_path": "d"})
        assert refused.status_code == 404 and "'d'" in refused.json()["error"]["message"], refused.text
        events = [first, *(line for line in lines if line.startswith("data:"))]
    last = json.loads(next(e for e in reversed(events) if e != "data: [DONE]")[5:])
    assert last["output_ids"] == expected["long"]
    info = lora_info(server.url)
    assert info["unloading"] == [] and "d" not in [s["adapter"] for s in info["slots"]], info


@pytest.fixture(scope="module")
def cluster(made):
    """A prefill with the three adapters, two decodes with a and b only."""
    paths = [f"{n}={p}" for n, p in made["paths"].items()]
    flags = ("--model", str(made["base"]), "--page-size", "4", "--enable-lora", "--max-loras-per-batch", "2")
    c = start_cluster(
        n_decode=2, flags=flags, prefill_flags=("--lora-paths", *paths), decode_flags=("--lora-paths", *paths[:2])
    )
    yield c
    c.stop()


def test_pd_mixed_batch_equals_peft(cluster, expected):
    """The adapter crosses with the room request; each half pins it in a slot of its own."""
    cases = [(n, i) for n in (None, "a", "b") for i in range(3)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: generate(cluster.url, expected["prompts"][c[1]], c[0]), cases))
    for (name, i), answer in zip(cases, answers):
        assert answer["output_ids"] == expected["tokens"][name][i], f"adapter {name}, prompt {i}"
    cluster.wait_idle()


def test_pd_an_adapter_the_decode_lacks_is_404_naming_it(cluster, expected):
    """The router knows each worker's adapters (its /v1/models): c, which only the prefill has, is its 404 naming c
    and the decodes; the decode itself refuses it too, before reserving anything."""
    body = {"input_ids": expected["prompts"][2], "lora_path": "c", "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(cluster.url + "/generate", json=body, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path", r.text
    assert r.json()["error"]["message"] == (
        "lora_path 'c': no decode worker serves the adapter 'c'; the decode workers' adapters: 'a', 'b'"
    )
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}  # refused before it is used
    r = httpx.post(cluster.decodes[0].url + "/generate", json={**body, **room}, timeout=60)
    assert r.status_code == 404 and "lora_path 'c': no such adapter" in r.json()["error"]["message"], r.text
    cluster.wait_idle()


TIER = ("--page-size", "4", "--max-total-tokens", "64", "--enable-hierarchical-cache", "--hicache-ratio", "8")
TIER += ("--hicache-write-policy", "write_back", "--hicache-storage-prefetch-policy", "wait_complete")


@pytest.fixture(scope="module")
def tiered(made, tmp_path_factory):
    """Two servers of adapters a and b over one file store, each with a device pool of 16 pages and a host tier
    behind it; the second numbers the adapters the other way round (b first), as another server may."""
    store = json.dumps({"file_path": str(tmp_path_factory.mktemp("store")), "prefetch_threshold": 0})
    flags = ("--model", str(made["base"]), "--enable-lora", *TIER, "--hicache-storage-backend", "file")
    flags += ("--hicache-storage-backend-extra-config", store)
    a, b = (f"{n}={made['paths'][n]}" for n in "ab")
    procs = [start_server(*flags, "--lora-paths", *paths, name=f"tier{i}") for i, paths in enumerate([(a, b), (b, a)])]
    yield [p.wait_ready() for p in procs]
    for p in procs:
        p.stop()


def test_the_same_prompt_under_two_adapters_from_the_host_tier_and_the_store(tiered, expected):
    """The prompt under a and b on the first server, its pages evicted to the host tier by base-model prompts that
    fill the device: each adapter hits its own pages there (host hit_tokens counts both); then on the second
    server, which numbers a and b the other way round, each reads its own from the store. Every answer equals
    peft's, and both tiers end with every page free or cached."""
    ids, full = expected["prompts"][3], (len(expected["prompts"][3]) - 1) // 4 * 4
    first, second = tiered
    for n in ("a", "b"):
        answer = generate(first.url, ids, n)
        assert answer["meta_info"]["cached_tokens"] == 0 and answer["output_ids"] == expected["tokens"][n][3], n
    for filler in random_prompts(3, 40, 40, seed=8):  # 13 pages each with its output: the device keeps none
        generate(first.url, filler, None)
    hits = first.info()["host_tier"]["hit_tokens"]
    for n in ("b", "a"):
        answer = generate(first.url, ids, n)
        assert answer["meta_info"]["cached_tokens"] == full and answer["output_ids"] == expected["tokens"][n][3], n
    assert first.info()["host_tier"]["hit_tokens"] - hits == 2 * full  # both from the host tier
    for n in ("a", "b"):
        answer = generate(second.url, ids, n)
        assert answer["meta_info"]["cached_tokens"] == full and answer["output_ids"] == expected["tokens"][n][3], n
    assert second.info()["kv_store"]["hit_tokens"] == 2 * full
    for server in tiered:
        server.wait_idle()
        host = server.info()["host_tier"]
        assert host["free"] + host["cached"] == host["total"] and host["locked"] == host["prefetching"] == 0


def stream_tokens(url: str, body: dict, seen: list[int]) -> list[int]:
    """A streamed /generate's output ids, `seen` holding how many arrived so far (its one element)."""
    ids: list[int] = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids = event["output_ids"]
                seen[0] = len(ids)
    return ids


def test_router_fans_load_and_unload_out_to_every_worker(cluster, made, expected):
    """The router's /load_lora_adapter reaches the prefill and both decodes: the prefill already serving c refuses
    (reported, naming it) while the decodes load it, the router re-reads their adapters at once, and c then runs
    through a pair; unloading reaches all three."""
    prefill, decode = cluster.prefills[0].url, cluster.decodes[0].url
    r = httpx.post(cluster.url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(made["paths"]["c"])})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(
        f"/load_lora_adapter failed on 1 of 3 workers: prefill {prefill}: 400"
    )
    assert sorted((w["role"], w["status"]) for w in r.json()["workers"]) == [
        ("decode", 200),
        ("decode", 200),
        ("prefill", 400),
    ]
    assert "c" in model_ids(decode)
    for i in range(2):
        assert generate(cluster.url, expected["prompts"][i], "c")["output_ids"] == expected["tokens"]["c"][i], i
    r = httpx.post(cluster.url + "/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert r.status_code == 200 and [w["status"] for w in r.json()["workers"]] == [200, 200, 200], r.text
    assert "c" not in model_ids(decode) and "c" not in model_ids(prefill)
    cluster.wait_idle()


def test_pd_a_stream_under_an_adapter_moves_with_it_when_its_decode_is_killed(cluster, expected):
    """A long greedy stream under b, its decode killed after 8 tokens: the router moves it (the body, so the
    adapter, goes with it) to the other decode, and the client's tokens equal the run without the fault (whose
    first 12 are peft's); the survivors free every page."""
    sampling = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": expected["prompts"][0], "lora_path": "b", "sampling_params": sampling}
    calm = stream_tokens(cluster.url, body, [0])
    assert calm[:NEW_TOKENS] == expected["tokens"]["b"][0] and len(calm) == 300
    seen = [0]
    with ThreadPoolExecutor(1) as pool:
        moved = pool.submit(stream_tokens, cluster.url, body, seen)
        deadline = time.monotonic() + 60
        while seen[0] < 8:
            assert time.monotonic() < deadline and not moved.done(), "the stream never reached 8 tokens"
            time.sleep(0.005)
        victim = max(cluster.decodes, key=lambda d: d.info()["num_running_reqs"])
        victim.signal(signal.SIGKILL)
        assert seen[0] < 300, "the stream ended before its decode was killed: the test would prove nothing"
        assert moved.result() == calm
    assert metric(cluster.url, "tandem_router_migrations_total", reason="decode_failed") >= 1
    for server in (*cluster.prefills, *(d for d in cluster.decodes if d is not victim)):
        server.wait_idle()


def start_up_error(*args: str) -> str:
    """The one line `tandem serve` ends with, exiting 1, before the weights load (after the config's log)."""
    run = subprocess.run([sys.executable, "-m", "tandem", "serve", *args], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and "Traceback" not in run.stderr and "weights" not in run.stderr, run.stderr
    return run.stderr.strip().splitlines()[-1]


def test_start_up_mistakes_take_one_line(made, tmp_path):
    base, a = str(made["base"]), str(made["paths"]["a"])
    other = save_tiny_llama(tmp_path / "wide", heads=8, kv_heads=4, head_dim=16)  # q_proj 128 rows, not 64
    wide = save_adapter(other, tmp_path / "wide-a", 4, 8, ["q_proj"], seed=9)
    serve = ["--model", base, "--enable-lora", "--lora-paths"]
    assert start_up_error(*serve, "x=/nonexistent") == (
        "tandem serve: --lora-paths x=/nonexistent: no adapter_config.json and adapter_model.safetensors there "
        "(give a PEFT adapter directory)"
    )
    assert start_up_error(*serve, f"a={a}", "--max-lora-rank", "2") == (
        "tandem serve: --lora-paths a: rank 4 is above --max-lora-rank 2 (raise it)"
    )
    assert start_up_error(*serve, f"w={wide}") == (
        "tandem serve: --lora-paths w: layer 0's q_proj (128x64) does not fit the model (2 layers, q_proj 64x64): "
        "the adapter was made for another base model"
    )
    assert start_up_error(*serve, f"a={a}", "--lora-target-modules", "q_proj") == (
        "tandem serve: --lora-paths a: targets v_proj, not in --lora-target-modules: add it"
    )
    assert start_up_error(*serve, f"a={a}", "--enable-dp-attention", "--tp-size", "2", "--dp-size", "2") == (
        "tandem serve: --enable-lora with --enable-dp-attention is not implemented yet: drop one of the two"
    )

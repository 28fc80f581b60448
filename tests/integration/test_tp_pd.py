"""PD across TP sizes (CPU): prefills and decodes at different `--tp-size`, each decode rank receiving
exactly its KV heads from the prefill rank(s) holding them. The built-in model (3 KV heads) pairs
(prefill TP, decode TP) = (1, 3), (3, 1), (3, 3) over Mooncake and (1, 3) over NIXL; a tiny Llama (8 heads, 4 KV
heads) pairs (4, 2) over NIXL (each decode rank takes two prefill ranks' heads; one prefill rank's heads split
over decode ranks is the built-in (1, 3)). Greedy tokens equal the monolithic server at TP 1 (transformers for the
tiny model; near-ties reported, see test_tensor_parallel), every pool is clean after, and a prefill at
TP > 1 counts bytes written by each of its ranks' own transfer engines. A decode of
a model with other KV heads is refused at pairing with both layouts named.

One module-scoped set of servers per model and backend (the built-in model's TP 1 pair is test_pd's, the
same flags: tests/conftest.py's SharedClusters); each pair is called directly (the router's rendezvous
fields, a fresh room per request)."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, start_server
from tests.integration.test_pd import CLUSTER_USERS, FLAGS, expected, mono, prompts  # noqa: F401  (fixtures)
from tests.integration.test_tensor_parallel import assert_same_tokens, greedy_reference
from tests.integration.tiny_model import random_prompts, save_tiny_llama

ROOMS = itertools.count(1 << 40)
NEW_TOKENS = 16


@dataclass
class Servers:
    """Prefills and decodes, by TP size (`shared`: those another module started, which `stop` leaves)."""

    prefills: dict[int, ServerProcess] = field(default_factory=dict)
    decodes: dict[int, ServerProcess] = field(default_factory=dict)
    shared: list[ServerProcess] = field(default_factory=list)

    def all(self) -> list[ServerProcess]:
        return [*self.prefills.values(), *self.decodes.values()]

    def prefill(self, tp: int) -> tuple[ServerProcess, int]:
        """The prefill at this TP size and its embedded bootstrap port."""
        server = self.prefills[tp]
        return server, int(server.arg("--bootstrap-port"))

    def stop(self) -> None:
        for s in self.all():
            if s not in self.shared:
                s.stop()


def start_servers(flags: tuple[str, ...], prefill_tps: tuple[int, ...], decode_tps: tuple[int, ...]) -> Servers:
    """All at once (tests/ports.py: no two servers race for a port), each ready."""
    s = Servers()
    try:
        for tp in prefill_tps:
            mode = ("--disaggregation-mode", "prefill", "--bootstrap-port", str(free_port()))
            s.prefills[tp] = start_server(*mode, *flags, "--tp-size", str(tp), name=f"prefill-tp{tp}")
        for tp in decode_tps:
            s.decodes[tp] = start_server(
                "--disaggregation-mode", "decode", *flags, "--tp-size", str(tp), name=f"decode-tp{tp}"
            )
        for server in s.all():
            server.wait_ready(300)
        return s
    except BaseException:
        s.stop()
        raise


def pair_call(
    prefill: tuple[ServerProcess, int], decode: ServerProcess, ids: list[int], prefill_timeout: float = 300
) -> httpx.Response:
    """What the router does: the same body, with the rendezvous fields, to both halves at once; the
    decode's answer (the prefill's must succeed too when the decode's did). A prefill half still
    waiting after `prefill_timeout` is cancelled as the router cancels it: its connection closes."""
    server, boot = prefill
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": boot,
        "bootstrap_room": next(ROOMS),
    }
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, server.url + "/generate", json=body, timeout=prefill_timeout)
        d = httpx.post(decode.url + "/generate", json=body, timeout=300)
        try:
            prefill_answer = p.result()
        except httpx.TimeoutException:
            prefill_answer = None
    if d.status_code == 200:
        assert prefill_answer is not None and prefill_answer.status_code == 200, prefill_answer
    return d


def pd_generate_all(servers: Servers, prefill_tp: int, decode_tp: int, prompts: list[list[int]]) -> list[dict]:
    pair = servers.prefill(prefill_tp), servers.decodes[decode_tp]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda ids: pair_call(*pair, ids), prompts))
    for r in answers:
        assert r.status_code == 200, r.text
    return [r.json() for r in answers]


TP3 = {"mooncake": ((3,), (3,)), "nixl": ((), (3,))}  # the TP 3 (prefills, decodes) each backend's pairs need
PAIRS = [("mooncake", 1, 3), ("mooncake", 3, 1), ("mooncake", 3, 3), ("nixl", 1, 3)]


@pytest.fixture(scope="module")
def builtin(request, shared_clusters):
    """The TP 3 servers of a backend, and test_pd's TP 1 pair of the same backend and flags (tests/conftest.py)."""
    flags = FLAGS[request.param]
    pair = shared_clusters.get(request.param, flags)
    s = start_servers(("--transfer-backend", request.param, *flags), *TP3[request.param])
    s.prefills[1], s.decodes[1] = pair.prefills[0], pair.decodes[0]
    s.shared = [pair.prefills[0], pair.decodes[0]]
    yield s
    s.stop()
    shared_clusters.done(request.param, flags, CLUSTER_USERS)


@pytest.mark.timeout(1200)  # eight processes of the built-in model start first
@pytest.mark.parametrize("builtin,prefill_tp,decode_tp", PAIRS, indirect=["builtin"], scope="module")
def test_builtin_pd_across_tp_sizes_equals_monolithic_tp1(builtin, prompts, expected, prefill_tp, decode_tp):
    got = pd_generate_all(builtin, prefill_tp, decode_tp, prompts)
    assert_same_tokens(expected, got, f"PD at TP {prefill_tp} -> {decode_tp}")
    for tp, server in ((prefill_tp, builtin.prefills[prefill_tp]), (decode_tp, builtin.decodes[decode_tp])):
        info = server.info()["tp"]  # each rank's heads and pool (the same pages on every rank)
        assert info["size"] == tp
        assert [(r["kv_heads"], r["first_kv_head"]) for r in info["ranks"]] == [
            (3 // tp, r * 3 // tp) for r in range(tp)
        ]
        assert len({r["kv_pages"] for r in info["ranks"]}) == 1
    if prefill_tp > 1:  # every prefill rank wrote its own heads with its own transfer engine
        sent = rank_bytes(builtin.prefills[prefill_tp])
        assert sorted(sent) == [str(r) for r in range(prefill_tp)] and all(v > 0 for v in sent.values()), sent
    for server in builtin.all():
        server.wait_idle()


def rank_bytes(server: ServerProcess) -> dict[str, float]:
    """tandem_kv_rank_bytes_total by rank, from the server's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    rows = [line for line in text.splitlines() if line.startswith("tandem_kv_rank_bytes_total{")]
    return {line.split('rank="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in rows}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with 4 KV heads at prefill TP 4 and decode TP 2, and (started with them) a decode of one
    with 2 KV heads."""
    root = tmp_path_factory.mktemp("tiny")
    model_dir = save_tiny_llama(root / "kv4", heads=8, kv_heads=4)
    other = save_tiny_llama(root / "kv2", heads=8, kv_heads=2)
    mode = ("--transfer-backend", "nixl", "--chunked-prefill-size", "64")
    other_decode = start_server("--disaggregation-mode", "decode", "--model", str(other), *mode, name="decode-kv2")
    try:
        s = start_servers(("--model", str(model_dir), *mode), (4,), (2,))
        s.model_dir, s.other_decode = model_dir, other_decode
        yield s
        s.stop()
    finally:
        other_decode.stop()


@pytest.mark.timeout(900)
def test_tiny_llama_pd_from_tp4_to_tp2_equals_transformers(tiny):
    prompts = random_prompts(4, 40, 150, seed=4)
    expected = greedy_reference(tiny.model_dir, prompts, NEW_TOKENS)
    got = pd_generate_all(tiny, 4, 2, prompts)
    assert_same_tokens(expected, got, "tiny PD at TP 4 -> 2")
    for server in tiny.all():
        server.wait_idle()


@pytest.mark.timeout(600)
def test_a_decode_of_other_kv_heads_is_refused_at_pairing_naming_both_layouts(tiny):
    decode = tiny.other_decode.wait_ready()
    r = pair_call(tiny.prefill(4), decode, random_prompts(1, 20, 20)[0], prefill_timeout=5)
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert "kv_heads: decode has 2, prefill has 4" in message
    assert "decode layout: tp_size=1, attention=mha, num_layers=2, kv_heads=2" in message
    assert "prefill layout: tp_size=4, attention=mha, num_layers=2, kv_heads=4" in message
    decode.wait_idle()
    for server in tiny.all():
        server.wait_idle(60)  # the prefill's half ended when its client went away

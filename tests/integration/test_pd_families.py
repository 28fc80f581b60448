"""PD for the MoE and MLA families over Mooncake and NIXL, and the pairing check that refuses a prefill
whose KV layout differs.

Per backend, one prefill and one decode of each tiny family run at once (module-scoped, both backends
in turn); requests go to a prefill and a decode directly with the router's bootstrap fields, so any
decode can be paired with any prefill. The families cover the pool kinds and cache dtypes:

    deepseek_v3  MLA latent, FP8 e4m3                    exact tokens of the monolithic engine
    deepseek_v2  MLA latent, unquantized, TP 2 both roles equal TP: rank r sends its (whole) latent to
                                                          decode rank r; near-ties reported
    qwen3_moe    MHA, FP8 e5m2                           exact
    mixtral      MHA, unquantized                        exact

The monolithic reference is the engine in this process with the same flags (the server's code, one
request at a time as the cluster serves them). Mismatched pairs fail at the decode with a message naming
the field and both values (model, attention kind, KV dtype and scales, transfer backend; page size:
test_kv_aware) and both layouts (TP sizes may differ: test_tp_pd), and no page leaks on either side.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.model.identity import model_identity
from common.wire.sampling_params import SamplingParams
from tests.conftest import ServerProcess, free_port, start_server
from tests.integration.moe_models import save_family
from tests.integration.test_architectures import VOCAB
from tests.integration.test_tensor_parallel import assert_same_tokens

NEW_TOKENS = 16
COMMON = ("--page-size", "4", "--chunked-prefill-size", "16")
FAMILY_FLAGS = {
    "deepseek_v3": ("--kv-cache-dtype", "fp8_e4m3"),
    "deepseek_v2": ("--tp-size", "2"),
    "qwen3_moe": ("--kv-cache-dtype", "fp8_e5m2"),
    "mixtral": (),
}
MLA_FP8_LINE = "KV cache: MLA, float8_e4m3fn, per-tensor scales 1.0 (the checkpoint has none)"
BACKENDS = ("mooncake", "nixl")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    return {f: save_family(tmp_path_factory.mktemp(f), f) for f in FAMILY_FLAGS}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 37, 90)]


def flags_of(model_dirs: dict, family: str) -> tuple[str, ...]:
    return ("--model", str(model_dirs[family]), *COMMON, *FAMILY_FLAGS[family])


def start_role(role: str, backend: str, flags: tuple[str, ...], name: str) -> tuple[ServerProcess, int]:
    """A prefill (with its embedded bootstrap registry on the returned port) or a decode, not yet ready."""
    boot = free_port()
    where = ("--bootstrap-port", str(boot)) if role == "prefill" else ()
    return start_server("--disaggregation-mode", role, "--transfer-backend", backend, *where, *flags, name=name), boot


@pytest.fixture(scope="module", params=BACKENDS)
def servers(request, model_dirs):
    """{family: ((prefill, bootstrap port), decode)} of one backend, all ready."""
    backend, made = request.param, {}
    try:
        for f in FAMILY_FLAGS:
            flags = flags_of(model_dirs, f)
            made[f] = (
                start_role("prefill", backend, flags, f"p-{f}"),
                start_role("decode", backend, flags, f"d-{f}")[0],
            )
        for (prefill, _), decode in made.values():
            prefill.wait_ready(300), decode.wait_ready(300)
        made = {f: ((p, int(p.arg("--bootstrap-port"))), d) for f, ((p, _), d) in made.items()}  # where it listens
        yield backend, made
    finally:
        for (prefill, _), decode in made.values():
            prefill.stop(), decode.stop()


async def _pair_call(prefill: tuple[ServerProcess, int], decode: ServerProcess, body: dict) -> httpx.Response:
    """Both halves at once, as the router sends them; a failed decode half closes the prefill's request."""
    body = body | {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill[1],
        "bootstrap_room": random.getrandbits(63),
    }
    async with httpx.AsyncClient(timeout=300) as client:
        prefill_half = asyncio.create_task(client.post(prefill[0].url + "/generate", json=body))
        answer = await client.post(decode.url + "/generate", json=body)
        if answer.status_code != 200:
            prefill_half.cancel()
        done = (await asyncio.gather(prefill_half, return_exceptions=True))[0]
        if answer.status_code == 200:
            assert done.status_code == 200, done.text
        return answer


def pd_generate(prefill, decode, ids: list[int]) -> httpx.Response:
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": 2}
    return asyncio.run(_pair_call(prefill, decode, body))


def monolithic_tokens(model_dir, family: str, prompts: list[list[int]]) -> list[list[int]]:
    """The monolithic engine (TP 1) in this process, one request at a time."""
    dtype = dict(zip(FAMILY_FLAGS[family][::2], FAMILY_FLAGS[family][1::2])).get("--kv-cache-dtype", "auto")
    config = ServerConfig(model=str(model_dir), page_size=4, chunked_prefill_size=16, kv_cache_dtype=dtype)
    engine, out = Engine(config), []
    for i, ids in enumerate(prompts):
        req = Req(f"r{i}", ids, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        engine.scheduler.add_request(req)
        while engine.scheduler.step():
            pass
        out.append(req.output_ids)
    return out


@pytest.mark.timeout(900)  # eight servers (twelve processes) start first
@pytest.mark.parametrize("family", list(FAMILY_FLAGS))
def test_pd_equals_monolithic(servers, model_dirs, prompts, family):
    backend, made = servers
    prefill, decode = made[family]
    want = monolithic_tokens(model_dirs[family], family, prompts)
    got = []
    for ids in prompts:
        r = pd_generate(prefill, decode, ids)
        assert r.status_code == 200, r.text
        got.append(r.json())
    if family == "deepseek_v2":  # TP 2 against TP 1: reductions in another order
        assert_same_tokens(want, got, f"{family} PD at TP 2 over {backend}")
    else:
        assert [g["output_ids"] for g in got] == want
    if family == "deepseek_v3":
        assert all(MLA_FP8_LINE in n.log_path.read_text() for n in (prefill[0], decode))
    prefill[0].wait_idle(), decode.wait_idle()


# (decode's family, prefill's family, what the decode's refusal says)
MISMATCHES = [
    ("mixtral", "qwen3_moe", "model_id: decode has '{d_id}', prefill has '{p_id}'"),
    ("deepseek_v3", "mixtral", "attention: decode has 'mla', prefill has 'mha'"),
    ("mixtral", "qwen3_moe", "dtype: decode has 'float32', prefill has 'float8_e5m2'"),
    ("qwen3_moe", "mixtral", "kv_scales: decode has 'k=1,v=1', prefill has 'none'"),
    ("deepseek_v3", "deepseek_v2", "(decode layout: tp_size=1, attention=mla"),  # TP sizes: named, may differ
]


def test_mismatched_layouts_are_refused_naming_the_field(servers, model_dirs, prompts):
    backend, made = servers
    for decode_family, prefill_family, said in MISMATCHES:
        ids = {"d_id": model_identity(model_dirs[decode_family]), "p_id": model_identity(model_dirs[prefill_family])}
        prefill, decode = made[prefill_family][0], made[decode_family][1]
        r = pd_generate(prefill, decode, prompts[1])
        assert r.status_code == 502, r.text
        assert said.format(**ids) in r.json()["error"]["message"]
    for (prefill, _), decode in made.values():
        prefill.wait_idle(), decode.wait_idle()
    assert "'attention': 'mla'" in made["deepseek_v3"][1].log_path.read_text()  # the decode's start-up layout


def test_decode_of_the_other_transfer_backend_is_refused(servers, model_dirs, prompts):
    backend, made = servers
    if backend != "mooncake":
        pytest.skip("one direction suffices: a NIXL decode refusing a Mooncake prefill")
    other = "nixl"
    decode = start_role("decode", other, flags_of(model_dirs, "mixtral"), f"d-mixtral-{other}")[0]
    try:
        r = pd_generate(made["mixtral"][0], decode.wait_ready(300), prompts[1])
        assert r.status_code == 502, r.text
        assert f"transfer_backend: decode has '{other}', prefill has '{backend}'" in r.json()["error"]["message"]
        decode.wait_idle(), made["mixtral"][0][0].wait_idle()
    finally:
        decode.stop()

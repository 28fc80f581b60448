"""How Tandem builds and plans FlashInfer's wrappers, checked on the CPU against a recording stand-in
(tests/unit/fake_flashinfer.py): the kernel family is pinned (fa2 unless --flashinfer-backend says
otherwise), what the wrappers are asked to read matches the torch backend, and a wrapper's plan() waits for
the copy out of its previous one."""

from __future__ import annotations

import pytest
import torch

from common.attention import flashinfer_backend
from common.attention.factory import make_attention_backend
from common.attention.flashinfer_backend import FlashInferAttention
from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.memory.kv_pool import KVPool
from common.wire.sampling_params import SamplingParams
from tests.integration.tiny_model import random_prompts, save_tiny_llama
from tests.unit import fake_flashinfer

PAGE, HQ, HKV, DIM = 4, 8, 2, 64


@pytest.fixture
def fi(monkeypatch):
    return fake_flashinfer.install(monkeypatch)


def pool() -> KVPool:
    return KVPool(2, 16, PAGE, HKV, DIM, torch.float32, "cpu")


def test_the_kernel_family_is_fa2_unless_the_flag_says_otherwise(fi):
    assert ServerConfig().flashinfer_backend == "fa2"
    for family in ("fa2", "auto"):
        attn = make_attention_backend("flashinfer", "cuda", pool(), HQ, DIM, DIM**-0.5, family)
        assert attn.prefill.kwargs["backend"] == family and attn.decode.kwargs["backend"] == family
    decode = fi.BatchDecodeWithPagedKVCacheWrapper.calls
    assert [w.kwargs["use_tensor_cores"] for w in decode] == [True, True]  # 4 query heads per KV head


class Event:
    """torch.cuda.Event's record / synchronize, written to a shared log."""

    def __init__(self, log: list):
        self.log = log

    def record(self) -> None:
        self.log.append(("record", self))

    def synchronize(self) -> None:
        self.log.append(("wait", self))


def test_a_wrappers_next_plan_waits_for_the_copy_out_of_its_previous_plan(fi, monkeypatch, tmp_path):
    """plan() copies from the wrapper's one pinned buffer asynchronously: five prefill chunks in a row (none
    samples, so nothing syncs the host between them), then decode steps; before each plan() the event recorded
    right after that wrapper's previous plan() is waited on."""
    log: list = []
    monkeypatch.setattr(flashinfer_backend, "plan_event", lambda device: Event(log))
    plan = fake_flashinfer._Wrapper.plan
    monkeypatch.setattr(
        fake_flashinfer._Wrapper, "plan", lambda w, *a, **k: log.append(("plan", w)) or plan(w, *a, **k)
    )
    model = save_tiny_llama(tmp_path, head_dim=64)
    engine = Engine(ServerConfig(model=str(model), max_total_tokens=4096, page_size=4, chunked_prefill_size=16))
    a = engine.runner.attn
    attn = engine.runner.attn = FlashInferAttention(engine.kv_pool, a.num_q_heads, a.head_dim, a.scaling)
    req = Req("r", random_prompts(1, 70, 71)[0], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    engine.scheduler.add_request(req)
    while engine.scheduler.step():
        pass
    assert len(req.output_ids) == 4
    planned = [w for kind, w in log if kind == "plan"]
    assert planned == [attn.prefill] * 5 + [attn.decode] * 3
    events = {w: e for (kind, e), (_, w) in zip(log, log[1:]) if kind == "wait"}
    assert len(set(map(id, events.values()))) == 2  # one event per wrapper, reused
    assert log == [step for w in planned for step in (("wait", events[w]), ("plan", w), ("record", events[w]))]

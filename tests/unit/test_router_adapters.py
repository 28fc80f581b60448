"""LoRA adapters at the router (router/adapters.py): the adapter a body names, the placer keeping a request on
workers that list its adapter, the KV index crediting an adapter only its own pages, and the 404 naming an adapter
no worker has."""

from __future__ import annotations

from common.wire.kv_events import block_hashes
from router.adapters import missing_adapter, request_adapter, served_models
from router.placement.kv_index import KVIndex
from router.placement.kv_policy import KVAwarePolicy
from router.placement.placer import Placer, pair_policy
from router.workers import WorkerRegistry

PAGE = 4


def models(*adapters: str) -> dict:
    """A /v1/models answer of the base model "tiny" and `adapters`."""
    cards = [{"id": "tiny", "parent": None}, *({"id": a, "parent": "tiny"} for a in adapters)]
    return {"object": "list", "data": cards}


def cluster(**lists: tuple[str, ...] | None) -> WorkerRegistry:
    """Healthy workers named p0, d0, ... (prefill when the name starts with p), each with its adapters (None: its
    /v1/models unknown)."""
    registry = WorkerRegistry(1)
    for name, adapters in lists.items():
        w = registry.add(f"http://{name}", "prefill" if name.startswith("p") else "decode")
        w.healthy, w.models = True, None if adapters is None else served_models(models(*adapters))
    return registry


class Feeds:
    model_path = None

    def __init__(self, workers: WorkerRegistry):
        self.workers = workers

    def block_size(self) -> int:
        return PAGE


def test_the_adapter_is_read_as_the_servers_read_it():
    workers = cluster(d0=("a",)).workers.values()
    assert [request_adapter(b, workers) for b in ({"model": "tiny"}, {"model": "a"}, {"model": "tiny:a"})] == [
        None,
        "a",
        "a",
    ]
    assert [request_adapter(b, workers) for b in ({}, {"model": "default"}, {"lora_path": "b", "model": "a"})] == [
        None,
        None,
        "b",
    ]
    unknown = cluster(d0=None).workers.values()  # no list known (--no-adapter-routing): the base model's
    assert request_adapter({"model": "a"}, unknown) is None and request_adapter({"lora_path": "a"}, unknown) is None


def test_the_placer_keeps_an_adapters_request_on_workers_that_list_it():
    """kv_aware over p0 (lists a), p1 (lists b), d0 (b), d1 (unknown): a's request goes to p0 and the unknown d1;
    b's to p1 and d0 (listed before unknown); the base model's anywhere."""
    registry = cluster(p0=("a",), p1=("b",), d0=("b",), d1=None)
    kv = KVAwarePolicy(KVIndex(), Feeds(registry), load_tokens=4)
    placer = Placer(registry, pair_policy("kv_aware", None, kv), kv)
    ids = list(range(16))
    bodies = ({"input_ids": ids, "lora_path": "a"}, {"input_ids": ids, "model": "tiny:b"}, {"input_ids": ids})
    picks = [(pair.prefill.url, pair.decode.url) for pair in map(placer.pick, bodies)]
    assert picks == [("http://p0", "http://d1"), ("http://p1", "http://d0"), ("http://p0", "http://d0")]


def test_a_prefix_cached_under_one_adapter_is_no_credit_to_another():
    """p1 holds the prompt's pages under "a": kv_aware sends a's request there, and b's and the base model's by
    load (p0, the first listed), as p1 holds nothing of theirs."""
    registry = cluster(p0=("a", "b"), p1=("a", "b"), d0=("a", "b"))
    index, ids = KVIndex(), list(range(16))
    index.stored("http://p1", block_hashes(ids, PAGE, "a"))
    kv = KVAwarePolicy(index, Feeds(registry), load_tokens=4)
    placer = Placer(registry, pair_policy("kv_aware", None, kv), kv)
    picks = [placer.pick({"input_ids": ids, "model": m}).prefill.url for m in ("a", "b", "tiny")]
    assert picks == ["http://p1", "http://p0", "http://p0"]
    assert kv.held_tokens(registry.workers["http://p1"], {"input_ids": ids, "model": "a"}) == 16
    assert kv.held_tokens(registry.workers["http://p1"], {"input_ids": ids, "model": "b"}) == 0


def test_an_adapter_no_worker_of_a_role_has_is_a_404_naming_it():
    registry = cluster(p0=("a", "b"), d0=("a",))
    workers = list(registry.workers.values())
    error = missing_adapter({"model": "b"}, workers)
    assert error is not None and error.status == 404 and error.param == "model"
    assert str(error) == "model 'b': no decode worker serves the adapter 'b'; the decode workers' adapters: 'a'"
    error = missing_adapter({"lora_path": "c"}, workers)
    assert error.param == "lora_path" and "no decode worker serves the adapter 'c'" in str(error)
    assert missing_adapter({"model": "a"}, workers) is None and missing_adapter({"model": "tiny"}, workers) is None
    workers[1].models = None  # a worker whose list is unknown may have it: the servers answer
    assert missing_adapter({"model": "b"}, workers) is None

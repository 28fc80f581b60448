"""What publishing KV cache events costs a scheduler step, with a subscriber attached that stops reading.

A stand-in for a decode step on the scheduler thread: a fixed torch workload (about a small model's CPU decode
step) and one request's KV handed to the radix cache per step (its prompt and answer pages cached, the oldest
evicted to keep the pool steady), as a busy decode server does. Three settings, taking turns step by step so the
machine's load hits all alike: no publisher; a publisher with nobody subscribed; a publisher with a SUB socket connected that never
reads (its receive buffer and the PUB's high-water mark fill, then PUB drops). Prints each setting's median and
p99 step time and the ratios.

    .venv/bin/python benchmarks/kv_events_overhead.py [--steps 2000] [--tokens 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.engine.kv_event_publisher import KVEventPublisher  # noqa: E402
from common.memory.allocator import PagedAllocator  # noqa: E402
from common.memory.radix_cache import RadixCache  # noqa: E402
from common.wire.kv_events import KVEventsConfig  # noqa: E402

PAGE, POOL_PAGES = 16, 4096


def one_step(cache: RadixCache, ids: list[int], a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(8):
        a = torch.tanh(a @ b)  # the forward's stand-in
    if cache.allocator.available_pages() < len(ids) // PAGE + 1:
        cache.evict(len(ids) // PAGE + 1)
    cache.cache_finished_req(ids, cache.allocator.alloc_token_slots(0, len(ids), -1), None)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=512)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    ctx = zmq.Context()
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", hwm=1000)
    publishers = {"subscriber stopped": KVEventPublisher(config, PAGE, "127.0.0.1")}
    publishers["nobody subscribed"] = KVEventPublisher(config, PAGE, "127.0.0.1")
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 10)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(publishers["subscriber stopped"].endpoint)  # and never reads
    time.sleep(0.5)
    settings = {"no events": None, **publishers}
    caches = {name: RadixCache(PagedAllocator(POOL_PAGES, PAGE), PAGE, pub) for name, pub in settings.items()}
    rng, times = random.Random(0), {name: [] for name in settings}
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    names = list(caches)
    for i in range(ns.steps):  # the settings take turns step by step, the first rotating: load hits all alike
        ids = [rng.randrange(50000) for _ in range(ns.tokens)]
        for name in names[i % 3 :] + names[: i % 3]:
            times[name].append(one_step(caches[name], ids, a, b))
    base = statistics.median(times["no events"])
    for name, ts in times.items():
        med, p99 = statistics.median(ts), sorted(ts)[int(0.99 * len(ts))]
        print(f"{name:20s} median {1000 * med:.3f} ms  p99 {1000 * p99:.3f} ms  median / no events {med / base:.3f}")
    for name, pub in publishers.items():
        print(f"{name:20s} batches {pub.batches}, dropped from the queue {pub.dropped}")
        pub.close()
    stalled.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()

"""How the router picks a worker of one role for a request."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict

from router.workers import Worker

BLOCK_CHARS = 64
MAX_BLOCKS = 100_000


class RandomPolicy:
    def pick(self, workers: list[Worker], key: str) -> Worker:
        return random.choice(workers)


class RoundRobinPolicy:
    def __init__(self) -> None:
        self.counter = itertools.count()

    def pick(self, workers: list[Worker], key: str) -> Worker:
        return workers[next(self.counter) % len(workers)]


class PowerOfTwoPolicy:
    def pick(self, workers: list[Worker], key: str) -> Worker:
        a, b = random.sample(workers, 2) if len(workers) > 1 else (workers[0], workers[0])
        return a if a.in_flight <= b.in_flight else b


class CacheAwarePolicy:
    """Prefer the worker that last served the longest prefix of this prompt (its radix cache likely
    still holds it), unless that worker is much busier than the least-loaded one."""

    def __init__(self, balance_slack: int = 8) -> None:
        self.owner: OrderedDict[str, str] = OrderedDict()  # hash of prompt prefix blocks -> worker url
        self.slack = balance_slack

    def _block_hashes(self, key: str) -> list[str]:
        h, out = hashlib.blake2b(digest_size=8), []
        for i in range(0, len(key) - BLOCK_CHARS + 1, BLOCK_CHARS):
            h.update(key[i : i + BLOCK_CHARS].encode())
            out.append(h.hexdigest())
        return out

    def pick(self, workers: list[Worker], key: str) -> Worker:
        least = min(workers, key=lambda w: w.in_flight)
        by_url = {w.url: w for w in workers}
        blocks = self._block_hashes(key)
        choice = least
        for h in reversed(blocks):
            w = by_url.get(self.owner.get(h, ""))
            if w is not None:
                choice = w if w.in_flight - least.in_flight <= self.slack else least
                break
        for h in blocks:
            self.owner[h] = choice.url
            self.owner.move_to_end(h)
        while len(self.owner) > MAX_BLOCKS:
            self.owner.popitem(last=False)
        return choice


def make_policy(name: str):
    return {
        "random": RandomPolicy,
        "round_robin": RoundRobinPolicy,
        "power_of_two": PowerOfTwoPolicy,
        "cache_aware": CacheAwarePolicy,
    }[name]()

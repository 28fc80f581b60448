"""The router's policies, and the one registry of their names (`POLICIES`): each picks the worker of one role
for a request; `--policy` picks the prefill and, unless `--decode-policy` is given, the decode.

`tandem router`'s flags, `tandem up --policy` and the README's table of policies read `POLICIES`: a new policy
is a class here (or in a file of its own, like kv_aware's) and one entry below. How a pair is made of two
policies, and which workers are candidates, is router/placement/placer.py.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.workers import Worker

if TYPE_CHECKING:
    from router.placement.kv_policy import KVAwarePolicy

BLOCK_CHARS = 64
MAX_BLOCKS = 100_000


class SidePolicy(Protocol):
    def pick(self, workers: list[Worker], body: dict[str, Any]) -> Worker:
        """One of `workers` (never empty) for the request `body`."""


class RandomPolicy:
    def pick(self, workers: list[Worker], body: dict[str, Any]) -> Worker:
        return random.choice(workers)


class RoundRobinPolicy:
    def __init__(self) -> None:
        self.counter = itertools.count()

    def pick(self, workers: list[Worker], body: dict[str, Any]) -> Worker:
        return workers[next(self.counter) % len(workers)]


class PowerOfTwoPolicy:
    def pick(self, workers: list[Worker], body: dict[str, Any]) -> Worker:
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

    def pick(self, workers: list[Worker], body: dict[str, Any]) -> Worker:
        least = min(workers, key=lambda w: w.in_flight)
        by_url = {w.url: w for w in workers}
        blocks = self._block_hashes(prompt_key(body))
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


def prompt_key(body: dict[str, Any]) -> str:
    """The prompt as text, for cache_aware's prefix blocks, after the LoRA adapter it may name (its `lora_path` or
    `model`): a prefix served under one adapter is no hint for another."""
    adapter = body.get("lora_path") or body.get("model")
    return f"{adapter}\0{prompt_text(body)}" if isinstance(adapter, str) else prompt_text(body)


def prompt_text(body: dict[str, Any]) -> str:
    for key in ("text", "prompt"):
        if isinstance(body.get(key), str):
            return body[key]
    if isinstance(body.get("messages"), list):
        return json.dumps(body["messages"])[:4096]
    if isinstance(body.get("input_ids"), list):
        return ",".join(map(str, body["input_ids"][:1024]))
    return ""


@dataclass(frozen=True)
class PolicySpec:
    summary: str  # one line: `--help` and the README's table of policies
    build: Callable[[str, KVAwarePolicy], SidePolicy]  # (role, the router's KV index policy) -> the role's picker
    decode_default: str | None = None  # the decode's policy when --decode-policy is not given (None: this one)
    kv_events: bool = False  # it reads the workers' KV cache events: `tandem up` turns them on


POLICIES: dict[str, PolicySpec] = {
    "random": PolicySpec("a worker at random", lambda role, kv: RandomPolicy()),
    "round_robin": PolicySpec("each worker in turn", lambda role, kv: RoundRobinPolicy()),
    "power_of_two": PolicySpec(
        "the less busy of two workers at random (requests in flight)", lambda role, kv: PowerOfTwoPolicy()
    ),
    "cache_aware": PolicySpec(
        "the worker that served the longest prefix of the prompt's text, unless much busier than the least busy; "
        "the decode by power_of_two",
        lambda role, kv: CacheAwarePolicy(),
        decode_default="power_of_two",
    ),
    "kv_aware": PolicySpec(
        "the worker of least cost in tokens by the exact index of the workers' KV cache events: tokens the prefill "
        "computes, or whose KV crosses to the decode, plus --kv-load-tokens per request in flight",
        lambda role, kv: kv.side(role),
        kv_events=True,
    ),
}


def decode_policy_name(policy: str, decode_policy: str | None) -> str:
    """The policy that picks the decode: --decode-policy, else --policy's decode default."""
    return decode_policy or POLICIES[policy].decode_default or policy

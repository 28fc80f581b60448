"""Where a request goes: a (prefill, decode) pair among the healthy workers, some excluded.

    Placer.pick(body, exclude)     the candidates: healthy workers of each role whose url is not in `exclude`
      └─▶ PairPolicy.pick_pair      the pair (PerSide: --policy's prefill, --decode-policy's decode)
      └─▶ KVAwarePolicy.observe     what the pair held of the prompt, counted under every policy

Whatever places a request (the dispatcher's first try, its retry on another pair, a later re-placement) asks
`Placer.pick` with the workers it must avoid. A policy whose cost is of the pair, not of each side, implements
`PairPolicy` itself; the policies of one side and their names are router/policies.py.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from router.kv_policy import KVAwarePolicy
from router.pair_call import Pair
from router.policies import POLICIES, SidePolicy, decode_policy_name
from router.workers import Worker, WorkerRegistry


class PairPolicy(Protocol):
    def pick_pair(self, prefills: list[Worker], decodes: list[Worker], body: dict[str, Any]) -> Pair:
        """A pair of the candidates (neither list empty) for the request `body`."""


@dataclass
class PerSide:
    """A pair of two policies of one side each."""

    prefill: SidePolicy
    decode: SidePolicy

    def pick_pair(self, prefills: list[Worker], decodes: list[Worker], body: dict[str, Any]) -> Pair:
        return Pair(self.prefill.pick(prefills, body), self.decode.pick(decodes, body))


def pair_policy(policy: str, decode_policy: str | None, kv: KVAwarePolicy) -> PairPolicy:
    """--policy and --decode-policy (names of router/policies.py's POLICIES) as one pair policy."""
    decode = decode_policy_name(policy, decode_policy)
    return PerSide(POLICIES[policy].build("prefill", kv), POLICIES[decode].build("decode", kv))


class Placer:
    def __init__(self, workers: WorkerRegistry, policy: PairPolicy, kv: KVAwarePolicy | None = None):
        self.workers, self.policy, self.kv = workers, policy, kv

    def pick(self, body: dict[str, Any], exclude: Collection[str] = ()) -> Pair | None:
        """The pair for `body` among the healthy workers whose url is not in `exclude`; None when a role has none."""
        prefills = [w for w in self.workers.healthy("prefill") if w.url not in exclude]
        decodes = [w for w in self.workers.healthy("decode") if w.url not in exclude]
        if not prefills or not decodes:
            return None
        pair = self.policy.pick_pair(prefills, decodes, body)
        if self.kv is not None:
            self.kv.observe(pair.prefill, pair.decode, body)
        return pair

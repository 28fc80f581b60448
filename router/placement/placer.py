"""Where a request goes: a (prefill, decode) pair among the healthy workers, some excluded, or a decode alone.

    Placer.pick(body, exclude, hints)  the candidates: healthy workers of each role whose url is not in `exclude`,
                                       those with the request's LoRA adapter first (router/adapters.py)
      └─▶ Placement.place               --pd-placement's rule (router/placement/rules.py): remote, two_way, cost;
           └─▶ PairPolicy.pick_pair      the pair (PerSide: --policy's prefill, --decode-policy's decode)
      └─▶ KVAwarePolicy.observe         what the pair held of the prompt, counted under every policy
      └─▶ tandem_router_placement_total{path, reason}

Whatever places a request (the dispatcher's first try, its retry on another pair, a later re-placement) asks
`Placer.pick` with the workers it must avoid. A policy whose cost is of the pair, not of each side, implements
`PairPolicy` itself; the policies of one side and their names are router/placement/policies.py.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from router.adapters import preferred, request_adapter
from router.metrics import RouterMetrics
from router.pair_call import Pair
from router.placement.kv_policy import KVAwarePolicy
from router.placement.policies import POLICIES, SidePolicy, decode_policy_name
from router.placement.rules import AlwaysRemote, CostPlacement, Placement, TwoWay, pick_decode
from router.placement.worker_stats import WorkerStats
from router.request_hints import NONE, RequestHints
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
    """--policy and --decode-policy (names of router/placement/policies.py's POLICIES) as one pair policy."""
    decode = decode_policy_name(policy, decode_policy)
    return PerSide(POLICIES[policy].build("prefill", kv), POLICIES[decode].build("decode", kv))


class Placer:
    """Places every try of a request: the workers it may use, then `placement` (--pd-placement's rule,
    router/placement/rules.py; always remote by default), or the decode alone when the client's headers force it."""

    def __init__(
        self,
        workers: WorkerRegistry,
        policy: PairPolicy,
        kv: KVAwarePolicy | None = None,
        placement: Placement | None = None,
        metrics: RouterMetrics | None = None,
    ):
        self.workers, self.policy, self.kv, self.metrics = workers, policy, kv, metrics
        self.placement = placement or AlwaysRemote(policy, kv)

    def pick(self, body: dict[str, Any], exclude: Collection[str] = (), hints: RequestHints = NONE) -> Pair | None:
        """Where `body` runs among the healthy workers whose url is not in `exclude`; None when nothing can serve
        it (no decode; no prefill, unless the placement computes prompts on decodes)."""
        adapter = request_adapter(body, self.workers.workers.values())
        prefills = preferred([w for w in self.workers.healthy("prefill") if w.url not in exclude], adapter)
        decodes = preferred([w for w in self.workers.healthy("decode") if w.url not in exclude], adapter)
        if not decodes:
            return None
        if hints.bypass_remote_prefill:
            pair: Pair | None = Pair(None, pick_decode(self.policy, decodes, body), "local", "forced")
        else:
            pair = self.placement.place(prefills, decodes, body, hints)
        if pair is None:
            return None
        pair.tpot_slo_s = hints.tpot_s
        if self.kv is not None:
            self.kv.observe(pair.prefill or pair.decode, pair.decode, body)
        if self.metrics is not None:
            self.metrics.placements.labels(pair.path, pair.reason).inc()
        return pair

    def first_token(self, pair: Pair, seconds: float) -> None:
        """A streamed try's first token came `seconds` after it was sent (the cost placement learns from it)."""
        learn = getattr(self.placement, "first_token", None)
        if learn is not None:
            learn(pair, seconds)


def placement_rule(name: str, policy: PairPolicy, kv: KVAwarePolicy, stats: WorkerStats, threshold: int) -> Placement:
    """--pd-placement's rule (router/placement/rules.py)."""
    if name == "two_way":
        return TwoWay(policy, kv, threshold)
    if name == "cost":
        return CostPlacement(kv, stats)
    return AlwaysRemote(policy, kv)

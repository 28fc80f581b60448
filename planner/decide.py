"""The planner's decision (docs/placement.md): from one Observation, how many prefill and decode servers there should
be, with Dynamo's three modes and hysteresis.

Each role has a pressure, 1 at its limit:

    throughput, latency   prefill  seconds to compute the prompts queued / QUEUE_S[mode]
                          decode   max(KV pages in use / KV_USE[mode], requests waiting for pages per decode / WAITING)
    sla                   prefill  min(observed p90 TTFT, predicted TTFT) / --ttft-ms
                          decode   max(observed p90 ITL / --itl-ms, requests waiting for pages per decode / WAITING)

sla reads leading signals, what a request arriving now would meet, and uses the observed latencies as a check. The
predicted TTFT (Observation.ttft_predicted_s) is its time at the prefills: the prompt tokens queued ahead of it and
its own (the mean prompt lately) at the prefills' measured rate, the estimate of Dynamo's load-based planner
(`estimate_next_ttft`: queued prefill tokens plus the mean input length, at the regressed time per chunk). The
observed p90 is of the first tokens the interval saw, so it lags: after a shift from long prompts to short ones,
the long prompts queued before the shift keep it high for many intervals while the queue is already empty, and a
flip to prefill would fix nothing. With the smaller of the two, a flip to prefill needs both the queue and the first
tokens to say the target is missed, and the prefill's pressure falls as soon as its queue has drained (Dynamo's SLA
planner caps its observed-over-expected TTFT correction at 1 for the same reason: queueing must not inflate the
prefill demand). With no first token in the interval the prediction counts alone while prompts are queued; with no
rate measured, the observation alone. The decode's ITL p90 is current already (the tokens the decodes made in the
interval); requests waiting for pages have no ITL yet, and their wait is TTFT that only more decodes remove: they
count as in latency mode.

Flip (a fixed number of servers): when a role's pressure is over 1, the planner weighs moving one server to it from
the other role, assuming a role's pressure is inversely proportional to its servers (P servers at pressure p: P + 1
at p * P / (P + 1)), and wants the move when it lowers the larger pressure by --margin at least. Scale (Kubernetes):
each role is sized on its own: over 1, to the servers that bring it to FILL; under SCALE_DOWN, down to that too.
Either way a change is made only once wanted --hysteresis intervals in a row, and not within --cooldown-s of the
last one; never below --min-prefill / --min-decode (or, scaling, above --max-*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.config import PlannerConfig
from planner.observe import Observation

QUEUE_S = {"throughput": 2.0, "latency": 0.5}  # seconds of queued prompts a prefill tolerates
KV_USE = {"throughput": 0.9, "latency": 0.7}  # decode KV pages in use it tolerates
WAITING = {"throughput": 4.0, "latency": 1.0, "sla": 1.0}  # decode requests waiting for pages, per decode
FILL = 0.8  # scaling aims each role's pressure here
SCALE_DOWN = 0.4


@dataclass
class Decision:
    prefill: int  # servers wanted now (the current counts when nothing changes)
    decode: int
    action: str  # none | to_prefill | to_decode (flip) | scale
    reason: str  # steady | over_target | under_target | hysteresis | cooldown | no_gain | min_servers
    pressure: dict[str, float] = field(default_factory=dict)


class Decider:
    def __init__(self, config: PlannerConfig):
        self.config = config
        self.wanted: tuple[int, int] | None = None  # the change wanted in the last intervals
        self.streak = 0
        self.cooldown_until = float("-inf")

    def pressures(self, obs: Observation) -> dict[str, float]:
        mode = self.config.mode
        waiting = obs.waiting_for_pages / max(obs.decode, 1) / WAITING[mode]
        if mode == "sla":
            itl = obs.itl_p90_s / (self.config.itl_ms / 1000) if obs.itl_p90_s is not None else 0.0
            return {"prefill": self._ttft(obs) / (self.config.ttft_ms / 1000), "decode": max(itl, waiting)}
        return {"prefill": obs.queue_s / QUEUE_S[mode], "decode": max(obs.kv_use / KV_USE[mode], waiting)}

    @staticmethod
    def _ttft(obs: Observation) -> float:
        """sla's TTFT: the smaller of the observed and the predicted; with no first token in the interval the
        prediction while prompts are queued (an idle cluster misses no target), with no rate the observation."""
        observed, predicted = obs.ttft_p90_s, obs.ttft_predicted_s
        if predicted is None:
            return observed or 0.0
        if observed is None:
            return predicted if obs.queue_tokens > 0 else 0.0
        return min(observed, predicted)

    def decide(self, obs: Observation, now: float) -> Decision:
        pressure = self.pressures(obs)
        target, reason = self._target(obs, pressure)
        current = (obs.prefill, obs.decode)
        if target == current:
            self.wanted, self.streak = None, 0
            return Decision(*current, "none", reason, pressure)
        self.streak = self.streak + 1 if target == self.wanted else 1
        self.wanted = target
        if self.streak < self.config.hysteresis:
            return Decision(*current, "none", "hysteresis", pressure)
        if now < self.cooldown_until:
            return Decision(*current, "none", "cooldown", pressure)
        self.wanted, self.streak, self.cooldown_until = None, 0, now + self.config.cooldown_s
        return Decision(*target, self._action(current, target), reason, pressure)

    def _action(self, current: tuple[int, int], target: tuple[int, int]) -> str:
        if self.config.actuator == "scale":
            return "scale"
        return "to_prefill" if target[0] > current[0] else "to_decode"

    def _target(self, obs: Observation, pressure: dict[str, float]) -> tuple[tuple[int, int], str]:
        if self.config.actuator == "scale":
            return self._sized(obs, pressure)
        return self._flipped(obs, pressure)

    def _flipped(self, obs: Observation, pressure: dict[str, float]) -> tuple[tuple[int, int], str]:
        """One server moved to the role over its limit, if that helps by the margin (the total stays)."""
        p, d, c = obs.prefill, obs.decode, self.config
        worst = max(pressure.values())
        if worst <= 1:
            return (p, d), "steady"
        to_prefill = pressure["prefill"] >= pressure["decode"]
        if (to_prefill and d - 1 < c.min_decode) or (not to_prefill and (p - 1 < c.min_prefill or p == 0)):
            return (p, d), "min_servers"
        after = (
            max(pressure["prefill"] * p / (p + 1), pressure["decode"] * d / (d - 1))
            if to_prefill
            else max(pressure["prefill"] * p / (p - 1), pressure["decode"] * d / (d + 1))
        )
        if after > (1 - c.margin) * worst:
            return (p, d), "no_gain"
        return ((p + 1, d - 1) if to_prefill else (p - 1, d + 1)), "over_target"

    def _sized(self, obs: Observation, pressure: dict[str, float]) -> tuple[tuple[int, int], str]:
        """Each role's replicas on its own, within the bounds."""
        c = self.config
        p = _size(obs.prefill, pressure["prefill"], c.min_prefill, c.max_prefill)
        d = _size(obs.decode, pressure["decode"], c.min_decode, c.max_decode)
        if (p, d) == (obs.prefill, obs.decode):
            return (p, d), "steady"
        return (p, d), "over_target" if p > obs.prefill or d > obs.decode else "under_target"


def _size(servers: int, pressure: float, low: int, high: int) -> int:
    if servers == 0 or SCALE_DOWN <= pressure <= 1:
        return min(max(servers, low), high)
    return min(max(math.ceil(servers * pressure / FILL), low), high)

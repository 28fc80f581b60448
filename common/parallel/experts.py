"""Expert parallelism's placement: which whole experts each rank holds (--ep-size), and, with
--ep-num-redundant-experts K, which experts have a second copy; EPLB (--enable-eplb) recomputes it from
the measured loads.

Every rank holds `slots` physical experts, `(E + K) / N` for E experts over N ranks. At start-up physical
slot s (rank s // slots) holds logical expert s % E, as SGLang lays them out: rank r holds a contiguous
run of experts and the K extra slots repeat the first K experts. A token's pair (token t, expert e) is
computed by one holder of e: `holders(e)[t % copies(e)]`, on every rank alike, so replicas share an
expert's tokens and no pair is computed twice.

`rebalance(loads)` (EPLB) gives the K extra copies to the experts of most tokens per copy, then packs
every copy, heaviest first, on the least loaded rank with a free slot that does not hold that expert yet
(greedy, deterministic: every rank computes the same placement from the same loads). It keeps the old
placement unless the new one lowers the busiest rank's tokens (no churn for nothing), and when packing
fails, which the greedy order makes rare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ExpertPlacement:
    num_experts: int
    held: list[list[int]]  # rank -> the logical experts it holds, ascending
    _table: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _copies: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def initial(cls, num_experts: int, ranks: int, redundant: int = 0) -> ExpertPlacement:
        slots = (num_experts + redundant) // ranks
        return cls(num_experts, [sorted({(r * slots + j) % num_experts for j in range(slots)}) for r in range(ranks)])

    @property
    def ranks(self) -> int:
        return len(self.held)

    def holders(self, expert: int) -> list[int]:
        return [r for r, mine in enumerate(self.held) if expert in mine]

    def owner(self, chosen: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """[T, k] the rank that computes each pair (token[t], chosen[t, j])."""
        if self._table is None:
            table = torch.zeros(self.num_experts, self.ranks, dtype=torch.int64)
            copies = torch.zeros(self.num_experts, dtype=torch.int64)
            for e in range(self.num_experts):
                hs = self.holders(e)
                table[e, : len(hs)] = torch.tensor(hs)
                copies[e] = len(hs)
            self._table, self._copies = table.to(chosen.device), copies.to(chosen.device)
        pick = token[:, None].to(chosen.device) % self._copies[chosen]
        return self._table[chosen, pick]

    def rank_loads(self, loads: list[int]) -> list[float]:
        """Tokens each rank would compute under this placement, an expert's tokens split over its copies."""
        copies = [len(self.holders(e)) for e in range(self.num_experts)]
        return [sum(loads[e] / copies[e] for e in mine) for mine in self.held]

    def rebalance(self, loads: list[int]) -> ExpertPlacement:
        """The placement for these per-expert token counts (see the module's docstring)."""
        slots, ranks = len(self.held[0]), self.ranks
        copies = [1] * self.num_experts
        for _ in range(slots * ranks - self.num_experts):
            e = max((e for e in range(self.num_experts) if copies[e] < ranks), key=lambda e: (loads[e] / copies[e], -e))
            copies[e] += 1
        items = sorted(
            ((loads[e] / copies[e], e) for e in range(self.num_experts) for _ in range(copies[e])),
            key=lambda i: (-i[0], i[1]),
        )
        held: list[list[int]] = [[] for _ in range(ranks)]
        work = [0.0] * ranks
        for load, e in items:
            free = [r for r in range(ranks) if len(held[r]) < slots and e not in held[r]]
            if not free:
                return self
            r = min(free, key=lambda r: (work[r], r))
            held[r].append(e)
            work[r] += load
        new = ExpertPlacement(self.num_experts, [sorted(h) for h in held])
        return new if max(new.rank_loads(loads)) < max(self.rank_loads(loads)) else self

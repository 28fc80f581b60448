"""The /metrics text of every Tandem process: its registry's families, each sample labelled with the
process's role, so one dashboard can tell prefill, decode, monolithic, router, bootstrap and planner apart even
when they are scraped without Kubernetes labels.

prometheus_client has no constant labels, so the label is added at scrape time, on copies of the
families the registry collects (the registry itself is left as it is).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

ROLE_LABEL = "role"
ROLES = ("null", "prefill", "decode", "router", "bootstrap", "planner")  # "null": a monolithic server


class WithRole:
    """A collector: the families of `registry`, each sample with `role=<role>` added."""

    def __init__(self, registry: Collector, role: str):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self.registry, self.role = registry, role

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            labelled = copy.copy(family)
            labelled.samples = [s._replace(labels=self._labels(family.name, s.labels)) for s in family.samples]
            yield labelled

    def _labels(self, family: str, labels: dict[str, str]) -> dict[str, str]:
        if ROLE_LABEL in labels:  # a bug of ours, found by any test that scrapes the process
            raise ValueError(
                f"metric {family} has a label named {ROLE_LABEL!r}, which is the process's: name that label otherwise"
            )
        return {**labels, ROLE_LABEL: self.role}


def render(registry: Collector, role: str) -> bytes:
    """The Prometheus text exposition of `registry`, every sample labelled `role=<role>`."""
    return generate_latest(WithRole(registry, role))

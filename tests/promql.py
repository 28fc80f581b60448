"""Metric names for the dashboard test: the series a PromQL query reads, and the series a process's
/metrics text lets a query read. The dashboard test asserts the first is a subset of the second."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# what follows each metric family type in the names of its series
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
    "untyped": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?")
_SELECTOR = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_LABEL_VALUES = re.compile(r"label_values\((.+),\s*([a-zA-Z_]\w*)\s*\)")


def query_metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects: identifiers that are not functions, keywords, label names in
    matchers or groupings, nor parts of durations or Grafana variables ($__rate_interval)."""
    expr = _STRINGS.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # dashboard variables
    expr = _GROUPING.sub("", expr)
    return {m.group(1) for m in _IDENT.finditer(expr) if not m.group(2) and m.group(1).lower() not in KEYWORDS}


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each `metric{...}` of `expr` with its (label, operator, value) matchers."""
    return [(m.group(1), _MATCHER.findall(m.group(2))) for m in _SELECTOR.finditer(expr)]


def matches(op: str, pattern: str, value: str) -> bool:
    """Whether a label `value` satisfies the matcher `op pattern` (regexes are anchored, as in PromQL)."""
    hit = value == pattern if op in ("=", "!=") else re.fullmatch(pattern, value) is not None
    return hit if op in ("=", "=~") else not hit


def exported_series(metrics_text: str) -> set[str]:
    """Every series name the families in a /metrics text can have, samples yet or not (a labelled
    counter no request has touched still announces itself with # TYPE)."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
        names.update(s.name for s in family.samples)
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[str]:
    """The `expr` of every target of every panel, rows' nested panels included (Grafana's JSON model)."""
    for panel in dashboard.get("panels", []):
        yield from dashboard_queries(panel)
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield target["expr"]


def variable_queries(dashboard: dict[str, Any]) -> Iterator[str]:
    """The PromQL selector of every `label_values(selector, label)` query variable."""
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = _LABEL_VALUES.fullmatch(query.strip())
            if m is None:
                raise ValueError(
                    f"variable {var['name']}: only label_values(selector, label) queries are checked, not {query!r}"
                )
            yield m.group(1)

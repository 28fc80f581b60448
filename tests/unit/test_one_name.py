"""One name per thing: no top-level function or class name is defined in two product modules, but for the
few that mean the same thing everywhere (ALLOWED, each with why). A second `describe` or `split_host_port`
is either the same rule written twice (keep one) or another thing under the same name (rename one)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "transfer", "bootstrap", "prefill_node", "decode_node", "router", "planner", "tandem")
ALLOWED = {"main": "the entry point of a module run with `python -m` (tandem.cli, common.ranks.follower)"}


def top_level_names() -> dict[str, list[str]]:
    """Name -> the product modules that define a function or class of that name at their top level."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name].append(str(path.relative_to(ROOT)))
    return found


def test_no_top_level_name_is_defined_in_two_modules():
    twice = {name: where for name, where in top_level_names().items() if len(where) > 1 and name not in ALLOWED}
    assert twice == {}


def test_every_allowed_name_is_still_defined_twice():
    """The allow-list shrinks with the code: an entry no longer needed goes."""
    names = top_level_names()
    assert [n for n in ALLOWED if len(names.get(n, [])) < 2] == []

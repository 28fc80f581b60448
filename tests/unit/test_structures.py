"""docs/structures.md lists every module of the product, one line each, and no module that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "transfer", "bootstrap", "prefill_node", "decode_node", "router", "planner", "tandem")
STRUCTURES = ROOT / "docs" / "structures.md"


def product_modules() -> set[str]:
    """Every .py of the product but the packages' `__init__.py` (a package is a heading of the page)."""
    return {str(p.relative_to(ROOT)) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py"}


def listed_modules() -> list[str]:
    """The modules the page lists: each list line starts with one backquoted path."""
    return re.findall(r"^- `([\w/]+\.py)`: \S", STRUCTURES.read_text(), flags=re.M)


def test_structures_lists_every_module_once_and_nothing_else():
    listed = listed_modules()
    assert len(listed) == len(set(listed)), sorted({m for m in listed if listed.count(m) > 1})
    assert sorted(product_modules() - set(listed)) == [], "modules missing from docs/structures.md"
    assert sorted(set(listed) - product_modules()) == [], "docs/structures.md lists modules that do not exist"

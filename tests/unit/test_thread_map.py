"""docs/architecture.md's thread map (section 10) names every thread the product names, and every thread the
product starts has a name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "transfer", "bootstrap", "prefill_node", "decode_node", "router", "planner", "tandem")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def thread_names() -> set[str]:
    """Every name the product gives a thread: `name=` of a threading.Thread, `thread_name_prefix` or the
    second argument of a ThreadPoolExecutor (an f-string's constant head, as `kv-transfer-…`)."""
    names = set()
    for path in (p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("Thread", "ThreadPoolExecutor"):
                given = [k.value for k in node.keywords if k.arg in ("name", "thread_name_prefix")]
                if ast.unparse(node.func).endswith("ThreadPoolExecutor") and len(node.args) > 1:
                    given.append(node.args[1])
                names.update(_constant_head(v) for v in given)
    return names


def _constant_head(value: ast.expr) -> str:
    if isinstance(value, ast.Constant):
        return value.value
    if isinstance(value, ast.JoinedStr) and isinstance(value.values[0], ast.Constant):
        return value.values[0].value + "…"
    raise AssertionError(f"a thread name the map cannot match: {ast.unparse(value)}")


def test_every_thread_the_product_names_is_in_the_thread_map():
    text = ARCHITECTURE.read_text()
    section = text[text.index("## 10. Threads") :]
    names = thread_names()
    assert {"scheduler", "kv-recv", "tp-ranks", "rank0-watch", "node-heartbeat", "kv-backend-init"} <= names
    assert sorted(n for n in names if f"`{n}`" not in section) == []


def test_every_thread_the_product_starts_has_a_name():
    """A thread without a name cannot be found in the map (nor in a stack dump)."""
    unnamed = []
    for path in (p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("threading.Thread"):
                if not any(k.arg == "name" for k in node.keywords):
                    unnamed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ThreadPoolExecutor"):
                if len(node.args) < 2 and not any(k.arg == "thread_name_prefix" for k in node.keywords):
                    unnamed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert unnamed == []

"""DESIGN.md section 2, enforced: which package may import which, and no torch in router/bootstrap."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"common", "transfer", "bootstrap", "prefill_node", "decode_node", "router", "tandem"}
ALLOWED = {
    "common": set(),
    "transfer": {"common"},
    "bootstrap": {"common"},
    "prefill_node": {"common", "transfer", "bootstrap"},
    "decode_node": {"common", "transfer", "bootstrap"},
    "router": {"common"},
    "tandem": PACKAGES,
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & PACKAGES


def test_packages_import_only_what_the_design_allows():
    violations = []
    for pkg, allowed in ALLOWED.items():
        for path in (ROOT / pkg).rglob("*.py"):
            bad = imported_packages(path) - allowed - {pkg}
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert violations == []


def test_router_and_bootstrap_start_without_torch():
    code = "import sys, router.app, tandem.router_cli, bootstrap.server, bootstrap.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

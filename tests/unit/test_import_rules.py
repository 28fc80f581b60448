"""The import rules of docs/architecture.md, enforced per package: which package may import which, each side of
the PD protocol apart from the other, the tensor-parallel building blocks (common/parallel) apart from the rank
processes (common/ranks), nothing in common naming a module of the CLI (tandem/), no torch in the router, the
bootstrap registry, the wire schemas (common.wire) or the `tandem bench` client, and no uvicorn or Starlette in
the router, the bootstrap registry or common.wire."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = {"common", "transfer", "bootstrap", "prefill_node", "decode_node", "router", "planner", "tandem"}
# package (folder) -> the packages it may import besides itself; a package not listed here follows its parent.
# common/config.py, the servers' config, counts as a package of its own.
ALLOWED = {
    "common": {"common"},
    "common/wire": set(),
    "common/edge": {"common/wire"},
    "common/core": {"common/wire"},
    "common/memory": {"common/core", "common/wire"},
    "common/attention": {"common/core", "common/memory", "common/wire"},
    "common/parallel": {"common/wire"},  # what models use: never the rank processes
    "common/quant": {"common/parallel", "common/wire"},  # quantized weights behind the parallel layers
    "common/model": {"common/core", "common/attention", "common/parallel", "common/quant", "common/wire"},
    "common/lora": {"common/config", "common/core", "common/model", "common/wire"},  # adapters of the models
    "common/ranks": {
        "common/config",
        "common/core",
        "common/memory",
        "common/attention",
        "common/model",
        "common/parallel",
        "common/quant",
        "common/wire",
    },
    "transfer": {"common/wire"},
    "bootstrap": {"common/wire", "common/edge"},
    "prefill_node": {"common", "transfer", "bootstrap"},
    "decode_node": {"common", "transfer", "bootstrap"},
    "router": {"common/wire", "common/edge"},
    "planner": {"common/wire", "common/edge", "router"},  # the router's worker stats: one reading of the workers
    "tandem": TOP,
}
# package -> libraries that no module it imports (ours, at any depth, function bodies included) may import
FORBIDDEN = {
    "router": {"torch", "uvicorn", "starlette", "fastapi"},
    "planner": {"torch", "uvicorn", "starlette", "fastapi"},
    "bootstrap": {"torch", "uvicorn", "starlette", "fastapi"},
    "common/wire": {"torch", "uvicorn", "starlette", "fastapi"},
}
# each side's transfer files and role: none imports the other side's (shared transfer files import neither)
SIDES = {"prefill": ("transfer/prefill", "prefill_node"), "decode": ("transfer/decode", "decode_node")}


def imported_modules(path: Path, ours: bool = True) -> set[str]:
    """The modules of ours (`ours`, else every module) a file imports when it runs (TYPE_CHECKING imports aside)."""
    found, tree = set(), ast.parse(path.read_text())
    for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]:
        block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m for m in found if not ours or m.split(".")[0] in TOP}


def module_file(module: str) -> Path | None:
    """The file of a module of ours (a package's __init__.py), None when it is a name inside a module."""
    path = ROOT / module.replace(".", "/")
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def allowed(importer: str, module: str) -> bool:
    """May files of package `importer` import `module`? Allowed packages match by path prefix."""
    target = module.replace(".", "/")
    return any(target == pkg or target.startswith(pkg + "/") for pkg in ALLOWED[importer] | {importer})


def test_packages_import_only_what_the_design_allows():
    violations = []
    for pkg in sorted(ALLOWED, key=len, reverse=True):
        for path in (ROOT / pkg).rglob("*.py"):
            owner = max((p for p in ALLOWED if path.relative_to(ROOT).as_posix().startswith(p + "/")), key=len)
            if owner != pkg:
                continue
            bad = sorted(m for m in imported_modules(path) if not allowed(pkg, m))
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {bad}")
    assert violations == []


def test_no_package_reaches_a_library_it_must_not_load():
    """FORBIDDEN, through every module of ours a package's files import, at any depth (function bodies too)."""
    violations = []
    for pkg, banned in FORBIDDEN.items():
        todo, seen = list((ROOT / pkg).rglob("*.py")), set()
        while todo:
            path = todo.pop()
            if path in seen:
                continue
            seen.add(path)
            bad = sorted(m for m in imported_modules(path, ours=False) if m.split(".")[0] in banned)
            if bad:
                violations.append(f"{pkg}: {path.relative_to(ROOT)} imports {bad}")
            todo += [f for f in map(module_file, imported_modules(path)) if f is not None]
    assert violations == []


def test_common_names_no_module_of_the_cli():
    """No string in common/ (docstrings and logger names aside) names a module of tandem/, such as an entry
    point to start: whoever starts common's processes passes it in."""
    cli = {p.stem for p in (ROOT / "tandem").iterdir() if p.suffix == ".py" or p.is_dir()} - {"__init__"}
    pattern = re.compile(r"\btandem[./](" + "|".join(sorted(cli)) + r")\b")
    violations = []
    for path in (ROOT / "common").rglob("*.py"):
        tree = ast.parse(path.read_text())
        skip = {id(ast.get_docstring(n, clean=False) and n.body[0].value) for n in ast.walk(tree) if _has_body(n)}
        skip |= {id(a) for n in ast.walk(tree) if _is_get_logger(n) for a in n.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if pattern.search(node.value):
                    violations.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert violations == []


def _has_body(node: ast.AST) -> bool:
    return isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))


def _is_get_logger(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func).endswith("getLogger")


# the router's placement room (router/placement): what it may import of the rest of the router
PLACEMENT_INPUTS = {"router.workers", "router.metrics", "router.pair_call", "router.request_hints"}


def test_the_placement_room_reads_only_its_inputs():
    """router/placement decides which pair; it reads the workers, counts metrics and returns a Pair, and
    reaches no other part of the router (the dispatcher, the app, the config)."""
    violations = []
    for path in (ROOT / "router/placement").rglob("*.py"):
        outside = {
            m for m in imported_modules(path) if m.startswith("router.") and not m.startswith("router.placement")
        }
        if outside - PLACEMENT_INPUTS:
            violations.append(f"{path.relative_to(ROOT)} imports {sorted(outside - PLACEMENT_INPUTS)}")
    assert violations == []


def test_each_side_imports_only_its_own_transfer_files():
    violations = []
    for side, (files, role) in SIDES.items():
        other = next(f for s, (f, _) in SIDES.items() if s != side)
        owners = [ROOT / files, ROOT / role, *(p for p in (ROOT / "transfer").glob("*.py"))]
        for path in (p for owner in owners for p in ([owner] if owner.is_file() else owner.rglob("*.py"))):
            bad = sorted(m for m in imported_modules(path) if m.replace(".", "/").startswith(other))
            if path.parent == ROOT / "transfer":
                bad += sorted(m for m in imported_modules(path) if m.replace(".", "/").startswith(files))
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {bad}")
    assert violations == []


def test_roles_reach_the_scheduler_only_through_the_view_they_are_built_with():
    """common/engine/role.py's SchedulerView: no role imports the Scheduler or rewires its KV manager."""
    for role in ("prefill_node/role.py", "decode_node/role.py"):
        assert "common.engine.scheduler" not in imported_modules(ROOT / role), role
        assert ".wake_scheduler" not in (ROOT / role).read_text(), role


def test_only_the_http_layer_and_the_cli_know_the_engine_facade():
    """Engine (common/engine/engine.py) is the HTTP layer's facade: nothing of the engine itself or of the roles
    imports it (TYPE_CHECKING imports included); start-up, warm-up, the report and the role composers take parts."""
    violations = []
    for pkg in ("common/engine", "prefill_node", "decode_node"):
        for path in (p for p in (ROOT / pkg).rglob("*.py") if p != ROOT / "common/engine/engine.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "common.engine.engine":
                    violations.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                elif isinstance(node, ast.Import) and any(a.name == "common.engine.engine" for a in node.names):
                    violations.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert violations == []


def test_router_bootstrap_wire_and_bench_start_without_torch(builtin_model_dir):
    """builtin_model_dir: the built-in model is converted already, as after any server ran once."""
    code = (
        "import sys, router.app, tandem.router_cli, bootstrap.app, bootstrap.client, common.wire.api, "
        "common.wire.auth, common.wire.body, common.wire.sse, common.wire.kv_layout, tandem.bench.main, "
        "tandem.bench.plot; tandem.bench.tokenizer.load_tokenizer('builtin'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_router_and_wire_start_without_uvicorn_or_starlette():
    """The HTTP frameworks of the engine servers stay in common/edge; the router serves with aiohttp."""
    code = (
        "import sys, router.app, router.serve, common.wire.api, common.wire.auth, common.wire.body, "
        "common.wire.drain, common.wire.sse; print(sorted({'uvicorn', 'starlette', 'fastapi'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports at import time (TYPE_CHECKING and function bodies aside)."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for pkg in TOP
        for p in (ROOT / pkg).rglob("*.py")
    }
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            ):
                continue
            for n in ast.walk(node):
                if isinstance(n, ast.Import):
                    found.update(a.name for a in n.names)
                elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                    found.update({n.module, *(f"{n.module}.{a.name}" for a in n.names)})
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def test_no_import_cycles_between_modules():
    graph, cycles = module_graph(), []

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)) for nxt in graph[start]
        )

    for module, imports in graph.items():
        cycles += [f"{module} -> {other} -> ... -> {module}" for other in imports if reaches(other, module, {other})]
    assert cycles == []

"""docs/architecture.md and the design pages it links (docs/*.md; performance.md, the measurements, aside)
name files and code that exist: every backquoted path (from the repository root; a module's path may leave
out .py) and every backquoted `Class.member` (a method, property, field, attribute its methods set or enum member of
a class of ours, or of a class it derives from, found in the source by ast) is checked, so a move or a rename cannot leave the
design pointing at nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
MEASUREMENTS = {"performance.md"}
PACKAGES = ("common", "transfer", "bootstrap", "prefill_node", "decode_node", "router", "planner", "tandem")
PATH = re.compile(r"[A-Za-z_][\w.-]*(/[\w.-]*)+")
MEMBER = re.compile(r"([A-Z]\w*)\.([A-Za-z_]\w*)")


def design_pages() -> list[Path]:
    """architecture.md and every page of docs/ it links to, but the measurements."""
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", DOC.read_text())) - MEASUREMENTS
    return [DOC, *(ROOT / "docs" / name for name in sorted(linked))]


def design_text() -> str:
    return "\n".join(p.read_text() for p in design_pages())


def backquoted(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def class_members() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Class name -> the names its body defines, and class name -> its base classes' names."""
    members: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for path in (p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                members.setdefault(node.name, set()).update(defined_names(node))
                bases.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1] for b in node.bases)
    return members, bases


def defined_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):  # attributes its methods set: self.x = ...
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
            names.add(node.attr)
    return names


def has_member(cls: str, name: str, members: dict[str, set[str]], bases: dict[str, set[str]]) -> bool:
    seen, todo = set(), [cls]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if name in members.get(current, set()):
            return True
        todo.extend(bases.get(current, set()))
    return False


def test_every_backquoted_path_exists():
    paths = [t for t in backquoted(design_text()) if PATH.fullmatch(t)]
    assert len(paths) > 20  # the doc still names its files
    assert [p for p in paths if not (ROOT / p).exists() and not (ROOT / f"{p}.py").exists()] == []  # a module


def test_every_backquoted_class_member_exists():
    members, bases = class_members()
    names = [t for t in backquoted(design_text()) if MEMBER.fullmatch(t)]
    assert len(names) > 10
    missing = [n for n in names if not has_member(*MEMBER.fullmatch(n).groups(), members, bases)]
    assert missing == []


def test_the_checks_catch_a_wrong_name():
    members, bases = class_members()
    assert has_member("DecodeRole", "release", members, bases)
    assert has_member("DecodeRole", "instance_id", members, bases)  # from its base, Role
    assert not has_member("DecodeRole", "lock", members, bases)
    assert not has_member("NoSuchClass", "run", members, bases)
    assert PATH.fullmatch("transfer/prefill/sender.py") and not (ROOT / "transfer/sender.py").exists()


def test_every_linked_design_page_exists():
    pages = design_pages()
    assert len(pages) > 5 and [p.name for p in pages if not p.exists()] == []

"""The two test tiers (docs/testing.md).

`make test` runs everything; `make test-fast` runs `-m "not slow or smoke"`. A test is `slow` by one rule:
it reaches a helper marked `@starts_processes` (ServerProcess, whose subclasses and callers such as
`start_server`, `start_cluster` and `start_router` are found through it, and the transfer tests' process
pairs), from its own body or from any fixture it uses, through any chain of test helpers. The few such
tests the fast tier keeps carry `@pytest.mark.smoke`.

Hypothesis example counts come from the profile that TANDEM_HYPOTHESIS_PROFILE names (`full` when unset);
a test's own `settings` leaves `max_examples` to the profile (the HTTP fuzz scales it: its four phases
share one test's timeout).
"""

from __future__ import annotations

import os
import types
from typing import Any

import pytest
from hypothesis import settings

PROFILE_ENV = "TANDEM_HYPOTHESIS_PROFILE"
PROFILES = {"fast": 40, "full": 500}  # examples per @given test (per phase of the HTTP fuzz)


def load_hypothesis_profile() -> None:
    for name, examples in PROFILES.items():
        settings.register_profile(name, max_examples=examples)
    name = os.environ.get(PROFILE_ENV, "full")
    if name not in PROFILES:
        raise pytest.UsageError(f"{PROFILE_ENV}={name!r}: use one of {', '.join(PROFILES)}")
    settings.load_profile(name)


def starts_processes(helper: Any) -> Any:
    """Marks a test helper (function or class) that starts processes: every test that reaches it is slow."""
    helper.starts_processes = True
    return helper


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code (nested functions and lambdas included) may load."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def reaches_process_start(fn: Any, seen: set[int] | None = None) -> bool:
    """Whether `fn` calls, directly or through test helpers (functions and classes in `tests.*`), a
    `@starts_processes` helper."""
    seen = set() if seen is None else seen
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    for name in _names(code):
        obj = fn.__globals__.get(name)
        if getattr(obj, "starts_processes", False):
            return True
        if not getattr(obj, "__module__", "").startswith("tests."):
            continue
        helpers = vars(obj).values() if isinstance(obj, type) else [obj]  # a test helper class: its methods
        if any(reaches_process_start(h, seen) for h in helpers if isinstance(h, types.FunctionType)):
            return True
    return False


def _starts_processes(item: pytest.Item) -> bool:
    fixtures = [fd.func for defs in item._fixtureinfo.name2fixturedefs.values() for fd in defs]
    return any(reaches_process_start(fn) for fn in [getattr(item, "function", None), *fixtures])


def mark_slow_tests(items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)

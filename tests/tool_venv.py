"""Command-line tools users install on their own, pipx-style (aiperf), each in its own virtual environment
under .cache (git-ignored), made once and reused: their requirements would change packages the shared .venv
pins. A cold install is minutes of downloads and disk writes, so tests/conftest.py starts it in the background
when a test that needs the tool is selected; `tool` waits for it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

TOOLS = {"aiperf": "aiperf==0.13.0"}  # tool name: what pip installs into its venv
INSTALL_TIMEOUT_S = 900  # a cold aiperf venv took 286 s on the shared 2-core machine (docs/testing.md)
UNREACHABLE = ("Could not find a version", "No matching distribution", "NewConnectionError", "Max retries exceeded")
IDLE_PRIORITY = ["nice", "-n", "19", *(["ionice", "-c", "3"] if shutil.which("ionice") else [])]
INSTALLS: dict[str, subprocess.Popen] = {}  # installs start_install began, by tool


def venv_dir(name: str) -> Path:
    return ROOT / ".cache" / f"{name}-venv"


def ready(name: str) -> bool:
    """Whether the tool's venv is complete (its marker is written after pip succeeded)."""
    return (venv_dir(name) / ".installed").exists()


def start_install(name: str) -> None:
    """The tool's venv made now in the background at a lower priority (nothing when it is already made)."""
    if ready(name) or name in INSTALLS:
        return
    path = venv_dir(name)
    shutil.rmtree(path, ignore_errors=True)  # a half-made one, from a run that stopped during its install
    path.parent.mkdir(parents=True, exist_ok=True)
    script = f'"{sys.executable}" -m venv "{path}" && "{path}/bin/python" -m pip install -q "{TOOLS[name]}" && touch "{path}/.installed"'
    with open(path.parent / f"{name}-venv.log", "w") as log:
        INSTALLS[name] = subprocess.Popen(
            # the lowest CPU and disk priority: the fault tests running meanwhile time their bounds
            [*IDLE_PRIORITY, "sh", "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_installs() -> None:
    """Kill the installs still running (a run that ended before its tool's test); the next run starts over."""
    for proc in INSTALLS.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    INSTALLS.clear()


def tool(name: str) -> Path:
    """The tool's executable, its venv made first if need be; a skip naming the reason when PyPI cannot be
    reached, a failure with pip's output otherwise."""
    start_install(name)
    if name in INSTALLS:
        INSTALLS.pop(name).wait(timeout=INSTALL_TIMEOUT_S)
    if not ready(name):
        log = (venv_dir(name).parent / f"{name}-venv.log").read_text(errors="replace")
        if any(sign in log for sign in UNREACHABLE):
            pytest.skip(f"pip cannot fetch {TOOLS[name]} (PyPI unreachable?): {log.strip().splitlines()[-1]}")
        pytest.fail(f"pip install {TOOLS[name]} into {venv_dir(name)} failed:\n{log[-3000:]}")
    return venv_dir(name) / "bin" / name

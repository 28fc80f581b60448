"""benchmarks/transfer_bench.py run as a user runs it: it ends on its own and prints a row per backend.
It used to hang with NIXL: the prefill process left through os._exit before its queue had sent the
result, and the decode process waited for a "done" sent to the wrong queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.tiers import starts_processes

CASE = "2k-prompt fragmented"
BOUND_S = 240


@starts_processes
def run_bench(*args: str) -> subprocess.CompletedProcess:
    """Run the benchmark in its own session, so that a hang kills its spawned children too."""
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/transfer_bench.py", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"transfer_bench.py {' '.join(args)} did not finish within {BOUND_S} s") from e
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_transfer_bench_finishes_and_reports_both_backends():
    for module in ("mooncake.engine", "nixl._api"):
        pytest.importorskip(module)
    done = run_bench("--backends", "nixl", "mooncake", "--cases", CASE, "--repeat", "2", "--layouts", "page-major")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if CASE in line and "done" not in line]
    assert [r[0] for r in rows] == ["nixl", "mooncake"], done.stdout
    for r in rows:
        mib, pieces, *speeds = r[4:]
        assert (
            r[3] == "page-major" and mib == "90.0" and pieces == "128"
        )  # one piece per page, none adjacent at the decode
        assert all(float(x) > 0 for x in speeds), r

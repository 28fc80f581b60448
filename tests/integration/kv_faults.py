"""A fault-injecting transport for tests: the transfer backend's KV writes, with one byte of one landing
flipped or one write dropped (reported as done). The unit tests wrap a backend with it directly; a server
process gets it through `kv_faults_site` (its sitecustomize, on PYTHONPATH) and TANDEM_TEST_KV_FAULTS_FILE:
the test writes "flip" or "drop" into that file and the process's next KV write batch suffers it (the file is
emptied then)."""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import threading
from collections.abc import Callable
from typing import Any

ENV_FILE = "TANDEM_TEST_KV_FAULTS_FILE"
NextFault = Callable[[], str | None]  # called once per write batch that carries KV: "flip", "drop" or None


def planned(faults: dict[int, str]) -> NextFault:
    """The `n`-th KV batch (counting from 1) suffers `faults[n]`."""
    count = itertools.count(1)
    return lambda: faults.get(next(count))


def armed(path: str) -> NextFault:
    """The next KV batch after the test wrote a fault into `path` suffers it."""

    def next_fault() -> str | None:
        try:
            with open(path, "r+") as f:
                fault = f.read().strip()
                if fault:
                    f.seek(0)
                    f.truncate()
                return fault or None
        except FileNotFoundError:
            return None

    return next_fault


def arm(path: str, fault: str) -> None:
    with open(path, "w") as f:
        f.write(fault)


def armed_still(path: str) -> bool:
    with open(path) as f:
        return bool(f.read().strip())


def inject(backend: Any, next_fault: NextFault, kv_only: Any = lambda nbytes: True, seed: int = 0) -> list[str]:
    """Make `backend`'s write batches that carry KV pieces (`kv_only(nbytes)`) suffer what `next_fault()`
    says: "flip" lands one random byte of one KV piece flipped (the piece is split around it, that byte sent
    from a registered staging byte: the source stays intact, the destination is another process's memory),
    "drop" leaves its KV pieces out (the rest of the batch, an aux record, still lands). Returns the log of
    what was done."""
    real, done, lock, rng = backend.write_batch, [], threading.Lock(), random.Random(seed)
    staging = (ctypes.c_ubyte * 64)()
    backend.register(ctypes.addressof(staging), len(staging))

    def write_batch(peer_id, src, dst, nbytes, *args, **kwargs):
        kv = [i for i, n in enumerate(nbytes) if kv_only(n)]
        with lock:
            fault = next_fault() if kv else None
        pieces = list(zip(src, dst, nbytes))
        if fault == "drop":
            pieces = [p for i, p in enumerate(pieces) if i not in kv]
            done.append(f"dropped {len(kv)} KV pieces to {peer_id}")
        elif fault == "flip":
            i = rng.choice(kv)
            s, d, n = pieces[i]
            k = rng.randrange(n)
            staging[0] = ctypes.c_ubyte.from_address(s + k).value ^ 0xFF
            flipped = [(s, d, k), (ctypes.addressof(staging), d + k, 1), (s + k + 1, d + k + 1, n - k - 1)]
            pieces[i : i + 1] = [p for p in flipped if p[2] > 0]
            done.append(f"flipped byte {k} of a {n}-byte piece to {peer_id}")
        if pieces:
            real(peer_id, *map(list, zip(*pieces)), *args, **kwargs)

    backend.write_batch = write_batch
    return done


def site_env(path: str) -> dict[str, str]:
    """The environment of a server process whose KV writes `path` arms (see the module docstring)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    site = os.path.join(root, "tests", "integration", "kv_faults_site")
    return {ENV_FILE: path, "PYTHONPATH": os.pathsep.join([site, root, os.environ.get("PYTHONPATH", "")])}

"""A fault-injecting transport for tests: the transfer backend's KV writes, with one byte of one landing
flipped or one write dropped (reported as done). The unit tests wrap a backend with it directly; a server
process gets it through `kv_faults_site` (its sitecustomize, on PYTHONPATH) and TANDEM_TEST_KV_FAULTS,
e.g. "flip:2,drop:5": flip a byte of the 2nd KV write batch, drop the 5th (counted per process)."""

from __future__ import annotations

import ctypes
import itertools
import random
import threading
from typing import Any

ENV = "TANDEM_TEST_KV_FAULTS"


def parse(plan: str) -> dict[int, str]:
    """ "flip:2,drop:5" -> {2: "flip", 5: "drop"}."""
    out = {}
    for item in filter(None, plan.split(",")):
        kind, _, n = item.partition(":")
        if kind not in ("flip", "drop") or not n.isdigit():
            raise ValueError(f"{ENV}: {item!r} is not flip:N or drop:N")
        out[int(n)] = kind
    return out


def inject(backend: Any, faults: dict[int, str], kv_only: Any = lambda nbytes: True, seed: int = 0) -> list[str]:
    """Make the `n`-th write batch of `backend` that carries KV pieces (`kv_only(nbytes)`; counting from 1)
    suffer `faults[n]`: "flip" lands one random byte of one KV piece flipped (the piece is split around it,
    that byte sent from a registered staging byte: the source stays intact, the destination is another
    process's memory), "drop" leaves its KV pieces out (the rest of the batch, an aux record, still lands).
    Returns the log of what was done."""
    real, count, done, lock, rng = backend.write_batch, itertools.count(1), [], threading.Lock(), random.Random(seed)
    staging = (ctypes.c_ubyte * 64)()
    backend.register(ctypes.addressof(staging), len(staging))

    def write_batch(peer_id, src, dst, nbytes, *args, **kwargs):
        kv = [i for i, n in enumerate(nbytes) if kv_only(n)]
        with lock:
            fault = faults.get(next(count)) if kv else None
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

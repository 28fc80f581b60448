"""Loaded by a test server process whose PYTHONPATH starts here (tests/integration/kv_faults.py): its
transfer backends get the faults TANDEM_TEST_KV_FAULTS plans (a prefill's: its KV writes)."""

import os

if os.environ.get("TANDEM_TEST_KV_FAULTS"):
    import transfer.backends.base as base
    from tests.integration.kv_faults import ENV, inject, parse

    make = base.make_backend
    faults = parse(os.environ[ENV])
    AUX_RECORD_MAX = 4096  # an aux record's piece is smaller than any page run

    def make_backend(*args, **kwargs):
        backend = make(*args, **kwargs)
        inject(backend, faults, kv_only=lambda nbytes: nbytes > AUX_RECORD_MAX)
        return backend

    base.make_backend = make_backend

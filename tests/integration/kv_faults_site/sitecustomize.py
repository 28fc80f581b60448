"""Loaded by a test server process whose PYTHONPATH starts here (tests/integration/kv_faults.py): its
transfer backends' KV writes suffer the faults the test writes into TANDEM_TEST_KV_FAULTS_FILE."""

import os
import sys

if os.environ.get("TANDEM_TEST_KV_FAULTS_FILE"):
    import transfer.backends.factory as factory
    from tests.integration.kv_faults import ENV_FILE, armed, inject

    make = factory.make_backend
    AUX_RECORD_MAX = 4096  # an aux record's piece is smaller than any page run

    def make_backend(*args, **kwargs):
        backend = make(*args, **kwargs)
        inject(backend, armed(os.environ[ENV_FILE]), kv_only=lambda nbytes: nbytes > AUX_RECORD_MAX)
        return backend

    factory.make_backend = make_backend
    manager = sys.modules.get("transfer.manager")
    if manager is not None:  # a server forked after its imports (tests/forked.py): the name is bound already
        manager.make_backend = make_backend

"""What signatures and TLS cost a decode's bootstrap lookup: the round trip of `lookup_prefill` over one
keep-alive connection (as `decode_node/peers.py` asks) to a `tandem bootstrap` process, plain and unsigned,
signed with a cluster secret, and signed over HTTPS (a certificate from a throwaway CA). Also the first
lookup of a new connection, which pays the TLS handshake. Decodes cache a lookup for 2 s and refresh it off
the request path, so this is not on a request's path in steady traffic.

    .venv/bin/python benchmarks/bootstrap_lookup.py [--lookups 500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bootstrap.client import lookup_prefill, register_prefill  # noqa: E402
from common.edge.tls import client_verify  # noqa: E402
from tests.conftest import ServerProcess, free_port  # noqa: E402
from tests.integration.tls_certs import make_certs  # noqa: E402

SECRET = "bench-secret"
ENTRY = {"role": "Prefill", "tp_size": 1, "tp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 9, "page_size": 16}
ENTRY |= {"num_layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "bfloat16", "transfer_backend": "mooncake"}
ENTRY |= {"model_id": "0123456789abcdef", "attention": "mha", "kv_scales": "none"}


def measure(url: str, secret: str | None, verify, lookups: int) -> tuple[float, float]:
    """(median ms of a lookup on a warm connection, ms of the first lookup on a new one)."""
    register_prefill(url, ENTRY, secret, verify=verify)
    t0 = time.perf_counter()
    with httpx.Client(timeout=5, verify=client_verify(verify)) as client:
        assert lookup_prefill(url, None, secret, client)["rank_port"] == 9
        first = time.perf_counter() - t0
        times = []
        for _ in range(lookups):
            t = time.perf_counter()
            lookup_prefill(url, None, secret, client)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times), 1000 * first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=500)
    ns = parser.parse_args()
    certs = make_certs(Path(tempfile.mkdtemp()))
    tls = ["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)]
    for name, secret, flags in (("plain", None, []), ("signed", SECRET, []), ("signed+TLS", SECRET, tls)):
        port = free_port()
        args = ["bootstrap", "--port", str(port), *(["--cluster-secret", SECRET] if secret else []), *flags]
        boot = ServerProcess(args, port, name=f"bench-boot-{name}", tls_ca=str(certs.ca) if flags else None)
        try:
            boot.wait_ready(60)
            warm, first = measure(boot.url, secret, str(certs.ca) if flags else True, ns.lookups)
            print(f"{name:<11} lookup p50 {warm:.2f} ms on a warm connection, first {first:.1f} ms")
        finally:
            boot.stop()


if __name__ == "__main__":
    main()

"""`tandem kv-store`: a Mooncake Store for the KV store tier (`--hicache-storage-backend mooncake`), as two
processes of the installed mooncake package:

    mooncake_master   objects' metadata, leases and eviction, and the HTTP metadata server through which
                      the store's clients find each other; /health on --metrics-port
    mooncake_client   the store's memory (--size): the servers give none, so no server's restart loses a page

Ctrl-C / SIGTERM stops both; either exiting stops the other. `tandem up --hicache-storage-backend mooncake`
runs one and gives every server `server_extra_config(...)`; the Helm chart runs one as a Deployment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from tandem.ports import require_free_ports

MASTER_PORT, METADATA_PORT, METRICS_PORT, CLIENT_PORT = 50051, 8080, 9003, 50052  # Mooncake's defaults


def mooncake_binary(name: str) -> str:
    import mooncake

    path = Path(mooncake.__path__[0]) / name
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def add_kv_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--advertise-host", help="the address servers reach the store at (default: --host)")
    p.add_argument("--port", type=int, default=MASTER_PORT, help="the master's RPC port (master_server_address)")
    p.add_argument("--metadata-port", type=int, default=METADATA_PORT, help="the HTTP metadata server's port")
    p.add_argument("--metrics-port", type=int, default=METRICS_PORT, help="the master's /health and /metrics")
    p.add_argument("--client-port", type=int, default=CLIENT_PORT, help="the memory-holding client's service port")
    p.add_argument("--size", default="4GB", help="the store's memory (Mooncake's global_segment_size)")
    p.add_argument(
        "--lease-ttl-ms", type=int, default=10_000, help="how long a page read keeps its object from eviction"
    )
    p.add_argument(
        "--eviction-high-watermark-ratio", type=float, default=0.9, help="how full the store gets before it evicts"
    )
    p.add_argument("--eviction-ratio", type=float, default=0.05, help="the share of its objects it then evicts")


def master_argv(
    host: str,
    port: int,
    metadata_port: int,
    metrics_port: int,
    lease_ttl_ms: int,
    eviction: tuple[float, float] = (0.9, 0.05),
) -> list[str]:
    """`eviction`: (high watermark, ratio), Mooncake's defaults."""
    return [
        mooncake_binary("mooncake_master"),
        f"--rpc_address={host}",
        f"--rpc_port={port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={metadata_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        f"--default_kv_lease_ttl={lease_ttl_ms}",
        f"--eviction_high_watermark_ratio={eviction[0]}",
        f"--eviction_ratio={eviction[1]}",
    ]


def client_argv(advertise: str, port: int, metadata_port: int, client_port: int, size: str) -> list[str]:
    return [
        mooncake_binary("mooncake_client"),
        f"--host={advertise}",
        f"--master_server_address={advertise}:{port}",
        f"--metadata_server=http://{advertise}:{metadata_port}/metadata",
        f"--port={client_port}",
        f"--global_segment_size={size}",
        "--protocol=tcp",
    ]


def server_extra_config(advertise: str, port: int, metadata_port: int) -> str:
    """What every server's --hicache-storage-backend-extra-config says to use this store."""
    metadata = f"http://{advertise}:{metadata_port}/metadata"
    return json.dumps({"master_server_address": f"{advertise}:{port}", "metadata_server": metadata})


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200 and bool(r.read().strip())
    except OSError:
        return False


def run_kv_store(ns: argparse.Namespace) -> int:
    advertise = ns.advertise_host or ns.host
    ports = {"--port": ns.port, "--metadata-port": ns.metadata_port, "--metrics-port": ns.metrics_port}
    require_free_ports(ns.host, ports | {"--client-port": ns.client_port})
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    master = subprocess.Popen(
        master_argv(
            ns.host,
            ns.port,
            ns.metadata_port,
            ns.metrics_port,
            ns.lease_ttl_ms,
            (ns.eviction_high_watermark_ratio, ns.eviction_ratio),
        )
    )
    procs = [master]
    try:
        base = f"http://{advertise}:{ns.metrics_port}"
        if not _wait(lambda: answers(base + "/health"), procs, stopping):
            return 1
        procs.append(subprocess.Popen(client_argv(advertise, ns.port, ns.metadata_port, ns.client_port, ns.size)))
        if not _wait(lambda: answers(base + "/get_all_segments"), procs, stopping):
            return 1
        print(
            f"[kv-store] Mooncake Store ready: {ns.size} at {advertise}; servers take "
            f"--hicache-storage-backend mooncake --hicache-storage-backend-extra-config "
            f"'{server_extra_config(advertise, ns.port, ns.metadata_port)}'",
            flush=True,
        )
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 0 if stopping else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(10)


def _wait(ready, procs: list[subprocess.Popen], stopping: list[int], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = next((p for p in procs if p.poll() is not None), None)
        if stopping or dead is not None or time.monotonic() > deadline:
            why = "stopped" if stopping else f"{dead.args[0]} exited" if dead else "not ready in 60 s"
            print(f"[kv-store] {why}", flush=True)
            return False
        time.sleep(0.2)
    return True


def add_up_store_flags(p: argparse.ArgumentParser) -> None:
    """`tandem up`'s flags for the KV store tier."""
    p.add_argument(
        "--hicache-storage-backend",
        choices=["file", "mooncake"],
        help="give every server a KV store they share (and the host tier in front of it); mooncake: tandem up "
        "runs `tandem kv-store` too",
    )
    p.add_argument(
        "--kv-store-port",
        type=int,
        default=MASTER_PORT,
        help="mooncake: the master's port; the next "
        "three are its metadata server's, its /health's and the memory-holding client's",
    )
    p.add_argument("--kv-store-size", default="4GB", help="mooncake: the store's memory")


def up_store(ns: argparse.Namespace, py: list[str]) -> tuple[list[str], list[str] | None, dict[str, int]]:
    """(the flags every server gets, the `tandem kv-store` command to run or None, the ports it listens on)."""
    if ns.hicache_storage_backend is None:
        return [], None, {}
    flags = ["--hicache-storage-backend", ns.hicache_storage_backend]
    if "--enable-hierarchical-cache" not in ns.extra:
        flags.insert(0, "--enable-hierarchical-cache")
    if ns.hicache_storage_backend == "file":
        return flags, None, {}
    port = ns.kv_store_port
    ports = {"--kv-store-port": port}
    ports |= {
        f"--kv-store-port + {i} (its {what})": port + i for i, what in ((1, "metadata"), (2, "health"), (3, "client"))
    }
    argv = py + ["kv-store", "--host", ns.host, "--port", str(port), "--metadata-port", str(port + 1)]
    argv += ["--metrics-port", str(port + 2), "--client-port", str(port + 3), "--size", ns.kv_store_size]
    flags += ["--hicache-storage-backend-extra-config", server_extra_config(ns.host, port, port + 1)]
    return flags, argv, ports

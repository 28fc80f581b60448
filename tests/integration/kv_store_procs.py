"""A Mooncake Store for tests: `mooncake_master` and a memory-holding `mooncake_client`, started as
`tandem kv-store` starts them (tandem/kv_store.py) but as two processes a test can kill and restart apart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from tandem.kv_store import answers, client_argv, master_argv
from tests.ports import free_port
from tests.tiers import starts_processes

HOST = "127.0.0.1"


@starts_processes
class MooncakeStoreProcs:
    def __init__(
        self,
        size: str = "64MB",
        lease_ttl_ms: int = 5000,
        name: str = "kv-store",
        eviction: tuple[float, float] = (0.9, 0.05),
    ):
        """`eviction`: the master's (high watermark, ratio)."""
        self.size, self.lease_ttl_ms, self.eviction = size, lease_ttl_ms, eviction
        self.port, self.metadata_port, self.metrics_port, self.client_port = (free_port() for _ in range(4))
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-test-{name}-{self.port}.log"
        self._log = open(self.log_path, "ab")
        self.master: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        try:
            self.start_master()
            self.start_client()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}"

    def extra_config(self, **more: object) -> str:
        return json.dumps(
            {
                "master_server_address": f"{HOST}:{self.port}",
                "metadata_server": f"http://{HOST}:{self.metadata_port}/metadata",
                **more,
            }
        )

    def start_master(self) -> None:
        argv = master_argv(HOST, self.port, self.metadata_port, self.metrics_port, self.lease_ttl_ms, self.eviction)
        self.master = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait(lambda: answers(self.url + "/health"), "the master's /health")

    def start_client(self) -> None:
        argv = client_argv(HOST, self.port, self.metadata_port, self.client_port, self.size)
        self.client = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_mounted()

    def wait_mounted(self, timeout: float = 30.0) -> None:
        """The memory-holding client's segment is mounted (again, after a master restart)."""
        self._wait(lambda: answers(self.url + "/get_all_segments"), "the client's segment", timeout)

    def corrupt(self, key: str) -> None:
        """Flip one bit of the page stored under `key` (a client of this store rewrites the object)."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        metadata = f"http://{HOST}:{self.metadata_port}/metadata"
        assert client.setup(HOST, metadata, 0, 16 * 2**20, "tcp", "", f"{HOST}:{self.port}") == 0
        try:
            data = bytearray(client.get(key))
            assert data, f"{key} is not in the store"
            data[-1] ^= 1
            assert client.remove(key, True) == 0
            assert client.put(key, bytes(data)) == 0
        finally:
            client.close()

    def free_bytes(self) -> int:
        """The store's memory not allocated to objects (the master's gauges)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        return int(values["master_total_capacity_bytes"] - values["master_allocated_bytes"])

    def kill_master(self) -> None:
        self.master.send_signal(signal.SIGKILL)
        self.master.wait(10)

    def _wait(self, ready, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if any(p is not None and p.poll() is not None for p in (self.master, self.client)):
                raise RuntimeError(f"a Mooncake Store process exited waiting for {what}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout} s; see {self.log_path}")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in (self.client, self.master):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._log.close()

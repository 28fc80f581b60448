"""The test servers' ports (tests/ports.py): outside the kernel's ephemeral range, never handed out twice,
one block per pytest process; and a server whose port was taken before it bound moves to a fresh one."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.conftest import ServerProcess
from tests.ports import BLOCK, LOWEST, ephemeral_range, free_port


def test_ports_are_distinct_and_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(BLOCK + 10)]  # into a second block
    assert len(set(ports)) == len(ports)
    assert all(p >= LOWEST and not low <= p <= high for p in ports)


def test_another_process_gets_other_ports():
    mine = {free_port() for _ in range(20)}
    code = "from tests.ports import free_port; print(*(free_port() for _ in range(20)))"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert mine.isdisjoint(int(p) for p in theirs.split())


def test_a_server_whose_port_is_taken_moves_to_a_fresh_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(["bootstrap", "--port", str(port)], port, name="moved-bootstrap")
        try:
            server.wait_ready(60)
            assert server.moves == 1 and server.port != port and server.arg("--port") == str(server.port)
            assert server.url.endswith(f":{server.port}")
            assert f"--port {port}: another process listens on" in server.log_path.read_text()
        finally:
            server.stop()

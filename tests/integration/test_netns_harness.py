"""The several-hosts harness itself (tests/integration/netns.py): what a killed run left is removed by the
next, and a drop rule loses one direction of traffic only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.netns import Network, remove_stale, sh, unavailable

pytestmark = pytest.mark.skipif(bool(why := unavailable()), reason=str(why))

LISTEN = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 7000))
print("ready", flush=True)
input()  # the sender has finished: from now on a datagram has 2 s to arrive
s.settimeout(2)
try:
    print(s.recv(64).decode())
except TimeoutError:
    print("nothing")
"""


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_what_a_killed_run_left_is_removed():
    tag = f"tnd{dead_pid()}"
    sh("ip", "netns", "add", f"{tag}-decode")
    sh("ip", "link", "add", tag, "type", "bridge")
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{tag}-decode", "sleep", "600"])
    try:
        remove_stale()
        assert f"{tag}-decode" not in sh("ip", "netns", "list").stdout
        assert sh("ip", "link", "show", tag, check=False).returncode != 0
        assert sleeper.wait(10) == -9  # its processes were killed, not left running outside any name
    finally:
        sleeper.kill()
        sh("ip", "netns", "del", f"{tag}-decode", check=False)
        sh("ip", "link", "del", tag, check=False)


def delivers(net: Network, src: str, dst: str) -> bool:
    """Whether a UDP datagram from src reaches a listener on dst (within 2 s of being sent: the clock starts
    after the sender's process has exited, so a slow start on a loaded machine is not a lost datagram)."""
    listener = subprocess.Popen(
        ["ip", "netns", "exec", net.hosts[dst].netns, sys.executable, "-c", LISTEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline() == "ready\n"
        send = f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hello', ('{net.hosts[dst].address}', 7000))"
        sh("ip", "netns", "exec", net.hosts[src].netns, sys.executable, "-c", send)
        listener.stdin.write("sent\n")
        listener.stdin.flush()
        return listener.stdout.readline() == "hello\n"
    finally:
        listener.kill()
        listener.wait()


def test_a_drop_loses_one_direction_only():
    net = Network()
    try:
        a, b = net.add_host("a"), net.add_host("b")
        assert delivers(net, "a", "b") and delivers(net, "b", "a")
        net.drop(a, b)
        assert not delivers(net, "a", "b") and delivers(net, "b", "a")
        assert net.dropped(b) > 0 and net.dropped(a) == 0
        net.heal()
        assert delivers(net, "a", "b")
    finally:
        net.close()

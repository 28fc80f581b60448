"""Several hosts on one machine: one Linux bridge and one network namespace per server, each with its own
address on 10.77.N.0/24, and nftables partitions between them.

Names carry this process's pid and a network number n (namespaces `tnd<pid>n<n>-<host>`, bridge
`tnd<pid>n<n>`, veths `tnd<pid>n<n>v<i>`), so two runs or two networks of one run never share one, and a
run removes what a killed run left (its pid no longer exists). Servers run inside their namespace through `ip netns exec`, listen on 0.0.0.0 and advertise their own address. A
partition is a drop rule in the receiving host's input chain: `drop(src, dst)` loses every packet from
src to dst (TCP segments and acknowledgements alike) and leaves the other direction alone.
`name_hosts(domain)` gives every host the name `<host>.<domain>` in every namespace: `ip netns exec` mounts
/etc/netns/<namespace>/hosts over /etc/hosts. Needs root, `ip` (iproute2) and `nft` (nftables);
`unavailable()` says why not."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ServerProcess
from tests.integration.cluster import Cluster

PORT = 8000  # every host has its own port space
BOOTSTRAP_PORT = 8998
STARTUP_S = 400.0  # four servers load the model at once, on a machine that may be shared
HOSTS_DIR = Path("/etc/netns")
TAG_RE = re.compile(r"^tnd(\d+)(?:n\d+)?(?:-|[vp]\d+$|$)")
NETWORKS = itertools.count()  # a tag per Network: a namespace kept alive by a straggler never collides


def sh(*cmd: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """Why this machine cannot host the namespaces (None when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package})"
    probe = f"tnd{os.getpid()}-probe"
    made = sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_stale() -> None:
    """Namespaces, their hosts files and links left by runs whose process is gone (killed before their
    finalizers ran)."""
    for line in sh("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = TAG_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                os.kill(int(pid), signal.SIGKILL)  # servers of the killed run, still inside
            sh("ip", "netns", "del", name, check=False)
    for path in HOSTS_DIR.glob("tnd*"):
        m = TAG_RE.match(path.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    for line in sh("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        m = TAG_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            sh("ip", "link", "del", name, check=False)


@dataclass
class Host:
    name: str
    netns: str
    address: str

    def nft(self, script: str) -> None:
        sh("ip", "netns", "exec", self.netns, "nft", "-f", "-", stdin=script)


@dataclass
class Network:
    """A bridge with an address for this process (the clients) and one namespace per host."""

    tag: str = field(default_factory=lambda: f"tnd{os.getpid()}n{next(NETWORKS) % 10}")
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        remove_stale()
        self.subnet = self._free_subnet()
        sh("ip", "link", "add", self.tag, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.tag)
        sh("ip", "link", "set", self.tag, "up")

    @staticmethod
    def _free_subnet() -> str:
        used = sh("ip", "-o", "addr").stdout
        for octet in [os.getpid() % 200 + 20, *range(20, 250)]:
            if f" 10.77.{octet}." not in used:
                return f"10.77.{octet}"
        raise RuntimeError("no free 10.77.N.0/24 subnet")

    def add_host(self, name: str) -> Host:
        i = len(self.hosts)
        host = Host(name, f"{self.tag}-{name}", f"{self.subnet}.{i + 2}")
        veth, inside = f"{self.tag}v{i}", f"{self.tag}p{i}"
        sh("ip", "netns", "add", host.netns)
        self.hosts[name] = host  # from here on close() removes it
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", inside)
        sh("ip", "link", "set", veth, "master", self.tag, "up")
        sh("ip", "link", "set", inside, "netns", host.netns)
        inns = ("ip", "netns", "exec", host.netns, "ip")
        sh(*inns, "link", "set", inside, "name", "eth0")
        sh(*inns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        sh(*inns, "link", "set", "eth0", "up")
        sh(*inns, "link", "set", "lo", "up")
        host.nft(
            "add table inet tandem\nadd chain inet tandem input { type filter hook input priority 0; policy accept; }"
        )
        return host

    def name_hosts(self, domain: str) -> dict[str, str]:
        """Every host resolvable as `<name>.<domain>` inside every namespace; {host name: its DNS name}."""
        names = {h.name: f"{h.name}.{domain}" for h in self.hosts.values()}
        lines = ["127.0.0.1 localhost", *(f"{h.address} {names[h.name]}" for h in self.hosts.values())]
        for host in self.hosts.values():
            (HOSTS_DIR / host.netns).mkdir(parents=True, exist_ok=True)
            (HOSTS_DIR / host.netns / "hosts").write_text("\n".join(lines) + "\n")
        return names

    def listening(self, host: Host) -> set[int]:
        """The TCP ports something listens on inside the host's namespace."""
        out = sh("ip", "netns", "exec", host.netns, "ss", "-Hltn").stdout
        return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}

    def drop(self, src: Host, dst: Host) -> None:
        """Every packet from src to dst is lost from now until heal()."""
        dst.nft(f"add rule inet tandem input ip saddr {src.address} counter drop")

    def heal(self) -> None:
        for host in self.hosts.values():
            host.nft("flush chain inet tandem input")

    def dropped(self, dst: Host) -> int:
        """Packets dst's drop rules have thrown away so far (proof that a partition was crossed)."""
        out = sh("ip", "netns", "exec", dst.netns, "nft", "list", "chain", "inet", "tandem", "input").stdout
        return sum(int(n) for n in re.findall(r"packets (\d+)", out))

    def close(self) -> None:
        for host in self.hosts.values():
            for pid in sh("ip", "netns", "pids", host.netns, check=False).stdout.split():
                with suppress(ProcessLookupError):  # a straggler would keep the namespace and its veth alive
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", host.netns, check=False)  # its veth end goes with it, and the pair
            shutil.rmtree(HOSTS_DIR / host.netns, ignore_errors=True)
        sh("ip", "link", "del", self.tag, check=False)
        self.hosts.clear()


def ns_server(host: Host, args: list[str], name: str, port: int = PORT, **kw) -> ServerProcess:
    """`python -m tandem <args>` inside the host's namespace; clients reach it at the host's address."""
    prefix = ("ip", "netns", "exec", host.netns)
    return ServerProcess(args, port, name=name, host=host.address, prefix=prefix, **kw)


@contextmanager
def ns_cluster(label: str, backend: str, flags: tuple[str, ...] = (), router_flags: tuple[str, ...] = (), env=None):
    """A fresh network with a cluster on it (see start_ns_cluster); everything is removed on exit. `label`
    names the servers' logs."""
    net = Network()
    try:
        c = start_ns_cluster(net, label, backend, flags, router_flags, env)
        try:
            yield c, net
        finally:
            c.stop()
    finally:
        net.close()


def start_ns_cluster(
    net: Network,
    label: str,
    backend: str,
    flags: tuple[str, ...] = (),
    router_flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Cluster:
    """Router, standalone bootstrap, one prefill and one decode, each on its own host of `net`, started at
    once, all ready.
    Engine servers get `flags` and `env` (e.g. UCX settings)."""
    hosts = {name: net.add_host(name) for name in ("router", "bootstrap", "prefill", "decode")}
    c = Cluster()
    try:
        boot = hosts["bootstrap"]
        c.bootstrap = ns_server(
            boot,
            ["bootstrap", "--host", "0.0.0.0", "--port", str(BOOTSTRAP_PORT)],
            f"ns-{label}-bootstrap",
            BOOTSTRAP_PORT,
        )
        for role in ("prefill", "decode"):
            host = hosts[role]
            args = ["serve", "--host", "0.0.0.0", "--port", str(PORT), "--advertise-host", host.address]
            args += ["--disaggregation-mode", role, "--transfer-backend", backend, "--max-total-tokens", "8192", *flags]
            if role == "prefill":
                args += ["--bootstrap-url", c.bootstrap.url]
            (c.prefills if role == "prefill" else c.decodes).append(
                ns_server(host, args, f"ns-{label}-{role}", env=env)
            )
        where = ["--prefill", c.prefills[0].url, f"{boot.address}:{BOOTSTRAP_PORT}", "--decode", c.decodes[0].url]
        args = ["router", "--host", "0.0.0.0", "--port", str(PORT), *where, "--health-check-interval-s", "0.5"]
        c.router = ns_server(hosts["router"], [*args, *router_flags], f"ns-{label}-router", health="/readiness")
        for server in (c.bootstrap, *c.nodes, c.router):  # started at once: the prefill registers once it can
            server.wait_ready(STARTUP_S)
        return c
    except BaseException:
        c.stop()
        raise

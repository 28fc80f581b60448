"""The start-up check of every command that listens: each port it will listen on is free, said as one line
naming the flag before anything loads (a model, a router process, the registry)."""

from __future__ import annotations

import errno
import socket

from common.wire.user_error import UserError


def require_free_ports(host: str, ports: dict[str, int]) -> None:
    """Each `--flag: port` can be listened on at `host`, and no two flags share a port; checked before
    a model loads, so that a port in use is said at once rather than after the load."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise UserError(f"{seen[port]} and {flag} are both {port}: give each its own port")
        seen[port] = flag
        _try_bind(host, port, flag)


def _try_bind(host: str, port: int, flag: str) -> None:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: past TIME_WAIT
        try:
            s.bind(address)
        except OSError as e:
            raise UserError(_bind_problem(e, host, port, flag)) from None


def _bind_problem(e: OSError, host: str, port: int, flag: str) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"{flag} {port}: another process listens on {host}:{port}; stop it or choose another port"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; use 127.0.0.1, 0.0.0.0 or one of its addresses"
    if e.errno == errno.EACCES:
        return f"{flag} {port}: this user may not listen on ports below 1024; choose a port above 1023"
    return f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror})"

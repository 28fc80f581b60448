"""Start-up errors a user causes: a flag out of range, flags that contradict each other, a model path that
is not there, a port another process holds. `UserError`'s message names the flag or path, says what is
wrong and what to do; `tandem` (tandem/cli.py) prints it as one line and exits 1, with a traceback only
under `--log-level debug`. Any other exception is a bug and keeps its traceback.

Torch-free, so the router and the bootstrap registry check their flags and ports with it too.
"""

from __future__ import annotations

import errno
import socket

from pydantic import ValidationError


class UserError(Exception):
    """A start-up error the user can fix; the message says what is wrong and what to do."""


def config_error(e: ValidationError) -> UserError:
    """The first problem of a config model's validation, named by its flag: `--page-size 0: Input
    should be ...`; a check across fields (no location) speaks for itself."""
    err = e.errors()[0]
    message = err["msg"].removeprefix("Value error, ")
    if not err["loc"]:
        return UserError(message)
    flag = "--" + ".".join(str(x) for x in err["loc"]).replace("_", "-")
    return UserError(f"{flag} {err.get('input')}: {message}")


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


def split_host_port(addr: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT` too) as (host, port); a ValueError naming --dist-init-addr otherwise."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--dist-init-addr {addr!r} is not HOST:PORT (e.g. 10.0.0.1:5000)")
    return host, int(port)

"""HOST:PORT as flags give it (--dist-init-addr, the router's discovery names, `tandem router`'s prefill
bootstrap): the one parser every process uses."""

from __future__ import annotations


def split_host_port(value: str, example: str = "10.0.0.1:5000") -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT` too) as (host, port); a ValueError saying what a good one looks like otherwise."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. {example})")
    return host, int(port)

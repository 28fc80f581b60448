"""A rendered container run as a local process: its command, args and env, with only what a cluster
provides swapped: each container's ports for free local ones, 0.0.0.0 for 127.0.0.1, the Services' DNS
names for `localhost`, the pod IP for 127.0.0.1, Secret references for the rendered Secret's value, and the
volumes' mount paths for the local directories that hold what the volumes would."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tests.conftest import ServerProcess
from tests.helm.chart import container, secret_value

# (argv after the command, port, name, health, env) -> a started process; ServerProcess runs `python -m tandem`
Spawn = Callable[..., ServerProcess]


def localize(args: list[str], values: dict[str, str]) -> list[str]:
    """`args` with the value after each flag in `values` swapped; every one must be there."""
    out = list(args)
    for name, value in values.items():
        assert out.count(name) == 1, f"{name} is not in {args}"
        out[out.index(name) + 1] = value
    return out


def local_paths(value: str, mounts: dict[str, Path]) -> str:
    """`value` with a mount path that starts it (or follows `NAME=`) swapped for its local directory."""
    for mount, local in mounts.items():
        value = re.sub(rf"(^|=){re.escape(mount)}(?=/|$)", lambda m, d=str(local): m.group(1) + d, value)
    return value


def local_env(c: dict, docs: list[dict]) -> dict[str, str]:
    env = {}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = "127.0.0.1"
        else:
            ref = source["secretKeyRef"]
            env[e["name"]] = secret_value(docs, ref["name"], ref["key"])
    return env


def process(
    docs: list[dict],
    role: str,
    flags: dict[str, str],
    port: int,
    health: str = "/health",
    spawn: Spawn | None = None,
    mounts: dict[str, Path] | None = None,
) -> ServerProcess:
    """The `role` container's `tandem` command with `flags` swapped, and each mount path in `mounts` for its local
    directory, started by `spawn` (a ServerProcess)."""
    spawn = spawn or ServerProcess
    c = container(docs, role)
    assert c["command"] == ["tandem"]  # ServerProcess runs `python -m tandem`, the same entry point
    mounts = mounts or {}
    args = [local_paths(a, mounts) for a in localize(c["args"], {"--host": "127.0.0.1", **flags})]
    left = [a for a in args if "svc.cluster.local" in a or a in ("0.0.0.0", "30000", "8998", "8000")]
    assert left == [], f"in-cluster values left in {role}'s command: {left}"
    mounted = {m["mountPath"] for m in c.get("volumeMounts", [])}
    assert mounts.keys() <= mounted, f"{role} mounts nothing at {mounts.keys() - mounted}"
    env = {k: local_paths(v, mounts) for k, v in local_env(c, docs).items()}
    return spawn(args, port, name=f"chart-{role}", health=health, env=env)

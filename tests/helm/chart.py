"""The Helm chart rendered by the real Helm engine (helm-python-sdk: Helm's Go SDK, no cluster, no
binary), and what the tests look up in its manifests."""

from __future__ import annotations

import argparse
import base64
import os
from pathlib import Path
from typing import Any
from unittest import mock

import helm_python
import yaml

from common.config import ServerConfig
from router.config import RouterConfig
from tandem.flags import add_model_flags
from tandem.router_cli import config_from_args

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tandem"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "llm"
TLS_MOUNT = "/etc/tandem/tls/"  # tls.mountPath's default


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "examples" / name).read_text())


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart makes for these values (NOTES.txt left out)."""
    with helm_python.Chart.load(chart) as c:
        out = c.render(values, name=RELEASE, namespace=NAMESPACE)
    return [
        doc
        for path, text in sorted(out.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def notes(values: dict[str, Any] | None = None) -> str:
    with helm_python.Chart.load(CHART) as c:
        out = c.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def component(docs: list[dict], kind: str, name: str) -> dict:
    """The one object of `kind` for a component (router, prefill, decode, bootstrap, ...)."""
    found = [d for d in objects(docs, kind) if d["metadata"]["labels"].get("app.kubernetes.io/component") == name]
    assert len(found) == 1, f"{len(found)} {kind} objects for {name}"
    return found[0]


def container(docs: list[dict], name: str) -> dict:
    return component(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    """The value after `name` in a container's args (the flag must be there exactly once)."""
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def service_host(name: str) -> str:
    return f"{RELEASE}-tandem-{name}.{NAMESPACE}.svc.cluster.local"


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def secret_value(docs: list[dict], name: str, key: str) -> str:
    secret = next(d for d in objects(docs, "Secret") if d["metadata"]["name"] == name)
    return base64.b64decode(secret["data"][key]).decode()


def parse_serve(args: list[str]) -> ServerConfig:
    """`tandem serve` args through the CLI's own flags and validation, as the container would run them."""
    assert args[0] == "serve", args
    parser = argparse.ArgumentParser()
    add_model_flags(parser, ServerConfig)
    return ServerConfig(**vars(parser.parse_args(args[1:])))


def parse_router(args: list[str]) -> RouterConfig:
    """`tandem router` args through its CLI; the TLS files it checks exist are the pod's (mounted from the
    Secret at tls.mountPath), taken as present."""
    assert args[0] == "router", args
    is_file = os.path.isfile
    with mock.patch("os.path.isfile", lambda p: p.startswith(TLS_MOUNT) or is_file(p)):
        return config_from_args(args[1:])

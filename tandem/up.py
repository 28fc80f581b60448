"""`tandem up`: the whole cluster on this machine, supervised; Ctrl-C / SIGTERM stops every child."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from common.model.locate import check_model
from common.wire.kv_layout import TRANSFER_BACKENDS
from common.wire.user_error import UserError
from router.placement.policies import POLICIES
from tandem.gpus import base_fraction, plan_gpus, visible_gpus
from tandem.kv_store import add_up_store_flags, up_store
from tandem.ports import require_free_ports


@dataclass
class Child:
    name: str
    argv: list[str]
    health_url: str
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    after: str | None = None  # start once this child is healthy (processes sharing a GPU)
    ports: dict[str, int] = field(default_factory=dict)  # what it listens on, by flag


def add_up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the endpoint clients use")
    p.add_argument("--mode", choices=["pd", "monolithic"], default="pd")
    p.add_argument("--transfer-backend", choices=TRANSFER_BACKENDS, default=TRANSFER_BACKENDS[0])
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--prefill-tp-size", type=int, default=1, help="--tp-size of every prefill server (pd mode)")
    p.add_argument("--decode-tp-size", type=int, default=1, help="--tp-size of every decode server (pd mode)")
    p.add_argument("--base-port", type=int, default=30000, help="first port of the prefill/decode servers")
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when a GPU is visible")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        default="cache_aware",
        help="the router's policy (see `tandem router --help`); kv_aware also turns on every engine's KV cache "
        "events (--kv-events-config)",
    )
    p.add_argument("--decode-policy", choices=list(POLICIES), help="the router's --decode-policy (default: --policy's)")
    p.add_argument(
        "--pd-placement",
        choices=["remote", "two_way", "cost"],
        default="remote",
        help="the router's --pd-placement (docs/placement.md); cost also turns on the engines' KV cache events",
    )
    p.add_argument(
        "--enable-pd-role-switch",
        action="store_true",
        help="every engine may switch roles (POST /pd_role_switch); each decode gets a bootstrap port of its own",
    )
    p.add_argument(
        "--planner",
        choices=["throughput", "latency", "sla"],
        help="also run `tandem planner` in this mode, flipping servers (implies --enable-pd-role-switch; more "
        "planner flags: TANDEM_PLANNER_* in the environment)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="clients send it to the router (Bearer), the router to the servers; every process gets it "
        "[env TANDEM_API_KEY]",
    )
    add_up_store_flags(p)
    p.add_argument("extra", nargs="*", help="more `tandem serve` flags for every engine server, after --")


def plan_children(ns: argparse.Namespace) -> list[Child]:
    """Every process of the cluster; the secrets go in their environment, not argv (`ps` shows argv)."""
    py = [sys.executable, "-m", "tandem"]
    store_flags, store_argv, store_ports = up_store(ns, py)
    common = ["--model", ns.model, "--host", ns.host, "--device", ns.device, *store_flags, *ns.extra]
    children = [Child("kv-store", store_argv, f"http://{ns.host}:{ns.kv_store_port + 2}/health", ports=store_ports)]
    children = children if store_argv else []
    if ns.mode == "monolithic":
        argv = py + ["serve", "--disaggregation-mode", "null", "--port", str(ns.port), *common]
        children.append(Child("server", argv, f"http://{ns.host}:{ns.port}/health"))
    else:
        children += _pd_children(ns, py, common)
        secret = os.environ.get("TANDEM_CLUSTER_SECRET") or secrets.token_hex(16)  # a fresh one per cluster
        for c in children:
            c.env["TANDEM_CLUSTER_SECRET"] = secret
    for c in children:
        if ns.api_key:
            c.env["TANDEM_API_KEY"] = ns.api_key
    return children


def kv_policy_flag(ns: argparse.Namespace) -> str | None:
    """The flag that names a policy (kv_aware) or placement (cost) reading the engines' KV cache events, if any."""
    named = (("--policy", ns.policy), ("--decode-policy", ns.decode_policy))
    found = next((f"{flag} {name}" for flag, name in named if name and POLICIES[name].kv_events), None)
    return found or ("--pd-placement cost" if getattr(ns, "pd_placement", None) == "cost" else None)


def kv_events_flags(ns: argparse.Namespace) -> list[str]:
    """With a policy that reads KV cache events (kv_aware) every engine publishes its cache's changes on ports
    it picks itself; the router learns them from each server's /get_server_info."""
    if kv_policy_flag(ns) is None:
        return []
    where = f"tcp://{ns.host}:*"
    return ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": where, "replay_endpoint": where})]


def _pd_children(ns: argparse.Namespace, py: list[str], common: list[str]) -> list[Child]:
    children, prefills, decodes = [], [], []
    common = kv_events_flags(ns) + (["--enable-pd-role-switch"] if switching(ns) else []) + common
    for i in range(ns.num_prefill):
        port, boot = ns.base_port + i, ns.bootstrap_port + i
        argv = py + [
            "serve",
            "--disaggregation-mode",
            "prefill",
            "--port",
            str(port),
            "--bootstrap-port",
            str(boot),
            "--transfer-backend",
            ns.transfer_backend,
            "--tp-size",
            str(ns.prefill_tp_size),
            *common,
        ]
        ports = {"--base-port": port, "--bootstrap-port": boot}
        children.append(Child(f"prefill-{i}", argv, f"http://{ns.host}:{port}/health", ports=ports))
        prefills += ["--prefill", f"http://{ns.host}:{port}", str(boot)]
    for j in range(ns.num_decode):
        port = ns.base_port + 100 + j
        argv = py + [
            "serve",
            "--disaggregation-mode",
            "decode",
            "--port",
            str(port),
            "--transfer-backend",
            ns.transfer_backend,
            "--tp-size",
            str(ns.decode_tp_size),
            *common,
        ]
        ports = {"--base-port": port}
        if switching(ns):  # its embedded registry, once it is a prefill
            boot = ns.bootstrap_port + ns.num_prefill + j
            argv += ["--bootstrap-port", str(boot)]
            ports["--bootstrap-port"] = boot
        children.append(Child(f"decode-{j}", argv, f"http://{ns.host}:{port}/health", ports=ports))
        decodes += ["--decode", f"http://{ns.host}:{port}"]
    router = py + ["router", *prefills, *decodes, "--host", ns.host, "--port", str(ns.port), "--policy", ns.policy]
    router += ["--decode-policy", ns.decode_policy] if ns.decode_policy else []
    router += ["--pd-placement", ns.pd_placement] if ns.pd_placement != "remote" else []
    children.append(Child("router", router, f"http://{ns.host}:{ns.port}/readiness"))
    if ns.planner:
        port = ns.base_port + 200
        planner = py + ["planner", "--router", f"http://{ns.host}:{ns.port}", "--mode", ns.planner]
        planner += ["--host", ns.host, "--port", str(port)]
        children.append(Child("planner", planner, f"http://{ns.host}:{port}/health", ports={"--base-port": port}))
    return children


def switching(ns: argparse.Namespace) -> bool:
    """Whether the engines may switch roles (--enable-pd-role-switch, or a planner that flips them)."""
    return bool(ns.enable_pd_role_switch or ns.planner)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop_all(children: list[Child]) -> None:
    for c in reversed(children):
        if c.proc and c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + 10
    for c in children:
        if c.proc:
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


def resolve_device(ns: argparse.Namespace) -> list[str]:
    """--device auto becomes cuda when a GPU is visible, else cpu; returns the GPUs to hand out."""
    gpus = visible_gpus() if ns.device != "cpu" else []
    if ns.device == "auto":
        ns.device = "cuda" if gpus else "cpu"
    return gpus


def place(ns: argparse.Namespace, children: list[Child], gpus: list[str]) -> list[str]:
    """What runs where; on CUDA each engine process gets its GPU (tandem/gpus.py)."""
    if ns.device == "cpu":
        return ["every process on the CPU"]
    return plan_gpus([c for c in children if c.name not in ENGINELESS], gpus, base_fraction(ns.extra))


ENGINELESS = ("router", "kv-store", "planner")  # children with no model: no GPU for them
UP_SETS = ("--model", "--host", "--port", "--device", "--disaggregation-mode", "--bootstrap-port", "--transfer-backend")
STORE_SETS = ("--hicache-storage-backend", "--hicache-storage-backend-extra-config")


def _check_policy(ns: argparse.Namespace) -> None:
    kv = kv_policy_flag(ns)
    if kv and ns.mode != "pd":
        raise UserError(f"{kv}: the router's policy needs --mode pd (a monolithic server has no router)")
    if kv and any(f.split("=")[0] == "--kv-events-config" for f in ns.extra):
        raise UserError(f"--kv-events-config after --: {kv} sets it on every server")


def check_up(ns: argparse.Namespace, children: list[Child]) -> None:
    """The user's mistakes that show before any process starts: counts, serve flags after `--` (their
    values, and the ones `tandem up` sets itself), the model, every port the cluster will listen on."""
    _check_policy(ns)
    for flag, n in (("--num-prefill", ns.num_prefill), ("--num-decode", ns.num_decode)):
        if n < 1 and ns.mode == "pd":
            raise UserError(f"{flag} {n}: a PD cluster needs at least 1 (or --mode monolithic)")
    for flag in ns.extra:
        if flag.split("=")[0] in STORE_SETS and ns.hicache_storage_backend:
            raise UserError(f"{flag} after --: `tandem up --hicache-storage-backend` sets it for every server")
        if flag.split("=")[0] in UP_SETS:
            raise UserError(f"{flag} after --: tandem up sets it for every server; give `tandem up {flag}` instead")
        if flag.split("=")[0] == "--tp-size" and ns.mode == "pd":
            raise UserError(
                f"{flag} after --: give `tandem up --prefill-tp-size A --decode-tp-size B` (they may differ)"
            )
    tp = max(ns.prefill_tp_size, ns.decode_tp_size)
    if ns.mode == "pd" and tp > 1 and ns.device == "cuda":
        raise UserError(
            f"--prefill-tp-size {ns.prefill_tp_size} --decode-tp-size {ns.decode_tp_size} with --device cuda: "
            "tandem up gives each server one GPU, and a server at --tp-size N needs N: start those servers with "
            "`tandem serve --tp-size N` (or the Helm chart's per-role tp)"
        )
    from tandem.cli import build_parser
    from tandem.server import server_config

    for c in children:
        if c.name not in ENGINELESS:
            server_config(build_parser().parse_args(c.argv[3:]))
    check_model(ns.model)
    ports = {"--port": ns.port}
    for c in children:
        ports |= {f"{flag} ({c.name})": port for flag, port in c.ports.items()}
    require_free_ports(ns.host, ports)


def run_up(ns: argparse.Namespace) -> int:
    gpus = resolve_device(ns)
    children = plan_children(ns)
    check_up(ns, children)
    try:
        lines = place(ns, children, gpus)
    except ValueError as e:
        print(f"[up] {e}", flush=True)
        return 1
    for line in lines:
        print(f"[up] {line}", flush=True)
    stopping = False

    def on_signal(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if ns.model == "builtin" and not _prepare_builtin(lambda: stopping):
            return 1
        return _supervise(ns, children, lambda: stopping)
    finally:
        print("[up] stopping every process...", flush=True)
        stop_all(children)
        print("[up] stopped", flush=True)


def _prepare_builtin(stopping) -> bool:
    """Convert the built-in model once, before several processes want it at the same time; False when it
    failed or the user stopped `tandem up` meanwhile."""
    print("[up] preparing the built-in model (first run converts it, about a minute)...", flush=True)
    code = "from common.model.loader import resolve_model_dir as r; r('builtin')"
    proc = subprocess.Popen([sys.executable, "-c", code], process_group=0)
    while proc.poll() is None and not stopping():
        time.sleep(0.1)
    if proc.poll() is None:
        proc.terminate()
        proc.wait()
    return proc.returncode == 0


def _start(c: Child) -> None:
    """Each child in its own process group: a Ctrl-C in the terminal reaches `tandem up` alone, which stops
    the children itself (SIGTERM), so none prints a KeyboardInterrupt traceback while still importing."""
    print(f"[up] starting {c.name}: {' '.join(c.argv[2:])}", flush=True)
    c.proc = subprocess.Popen(c.argv, env=os.environ | c.env, process_group=0)


def _supervise(ns: argparse.Namespace, children: list[Child], stopping) -> int:
    deadline = time.monotonic() + ns.startup_timeout
    pending, healthy_names = list(children), set()
    while pending and not stopping():
        for c in list(pending):
            if c.proc is None:
                if c.after is None or c.after in healthy_names:
                    _start(c)
                continue
            if c.proc.poll() is not None:
                print(
                    f"[up] {c.name} exited with code {c.proc.returncode} during start-up; see its log above", flush=True
                )
                return 1
            if healthy(c.health_url):
                print(f"[up] {c.name} is healthy", flush=True)
                pending.remove(c)
                healthy_names.add(c.name)
        if time.monotonic() > deadline:
            print(f"[up] timed out waiting for {[c.name for c in pending]}", flush=True)
            return 1
        time.sleep(0.5)
    if stopping():
        return 0
    url = f"http://{ns.host}:{ns.port}"
    auth = "-H 'Authorization: Bearer <your --api-key>' " if ns.api_key else ""
    print(
        f"\n[up] Tandem is serving on {url} (OpenAI-compatible). Try:\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' {auth}"
        f'-d \'{{"messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}\'\n'
        f"[up] press Ctrl-C to stop\n",
        flush=True,
    )
    while not stopping():
        for c in children:
            if c.proc.poll() is not None:
                print(f"[up] {c.name} exited with code {c.proc.returncode}; stopping the cluster", flush=True)
                return 1
        time.sleep(0.5)
    return 0

"""`tandem up` on GPUs: which GPU each process gets (planned from given GPU lists), how processes sharing
a GPU split --mem-fraction-static and start in turn, how the visible GPUs are found."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from common.config import ServerConfig
from common.wire.kv_layout import TRANSFER_BACKENDS
from common.wire.user_error import UserError
from tandem.gpus import base_fraction, plan_gpus, visible_gpus
from tandem.up import ENGINELESS, add_up_flags, check_up, plan_children, resolve_device
from tests.conftest import ROOT


def children(*args: str):
    p = argparse.ArgumentParser()
    add_up_flags(p)
    ns = p.parse_args(["--device", "cuda", *args])
    kids = plan_children(ns)
    return kids, {c.name: c for c in kids}, [c for c in kids if c.name not in ENGINELESS]


def test_enough_gpus_give_every_engine_process_its_own():
    kids, by_name, engines = children("--num-prefill", "2", "--num-decode", "2")
    lines = plan_gpus(engines, ["0", "1", "2", "3"], 0.85)
    assert [by_name[n].env["CUDA_VISIBLE_DEVICES"] for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")] == [
        "0",
        "1",
        "2",
        "3",
    ]
    assert lines == ["prefill-0 -> GPU 0", "prefill-1 -> GPU 1", "decode-0 -> GPU 2", "decode-1 -> GPU 3"]
    assert "CUDA_VISIBLE_DEVICES" not in by_name["router"].env
    assert all("--mem-fraction-static" not in c.argv and c.after is None for c in kids)


def test_fewer_gpus_are_shared_in_turn_with_a_cumulative_fraction():
    _, by_name, engines = children("--num-prefill", "2", "--num-decode", "2", "--", "--mem-fraction-static", "0.8")
    lines = plan_gpus(engines, ["4", "7"], base_fraction(by_name["prefill-0"].argv))
    assert {n: by_name[n].env["CUDA_VISIBLE_DEVICES"] for n in by_name if n != "router"} == {
        "prefill-0": "4",
        "prefill-1": "7",
        "decode-0": "4",
        "decode-1": "7",
    }
    assert by_name["prefill-0"].argv[-2:] == ["--mem-fraction-static", "0.4000"] and by_name["prefill-0"].after is None
    assert (
        by_name["decode-0"].argv[-2:] == ["--mem-fraction-static", "0.8000"]
        and by_name["decode-0"].after == "prefill-0"
    )
    assert lines[1] == "decode-0 -> GPU 4, shared by 2 processes (--mem-fraction-static 0.8000, starts after prefill-0)"


def test_one_gpu_monolithic_and_no_gpu_at_all():
    _, by_name, engines = children("--mode", "monolithic")
    assert plan_gpus(engines, ["0"], 0.85) == ["server -> GPU 0"]
    with pytest.raises(ValueError, match="no GPU is visible.*use --device cpu"):
        plan_gpus(engines, [], 0.85)


def test_visible_gpus_come_from_cuda_visible_devices_or_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible_gpus() == ["0", "1"]
    ns = argparse.Namespace(device="auto")
    assert resolve_device(ns) == ["0", "1"] and ns.device == "cuda"
    monkeypatch.setenv("PATH", "/nonexistent")
    ns = argparse.Namespace(device="auto")
    assert resolve_device(ns) == [] and ns.device == "cpu"


def test_up_with_cuda_and_no_visible_gpu_says_what_to_do():
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "up", "--device", "cuda"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "[up] --device cuda but no GPU is visible" in out.stdout and "use --device cpu" in out.stdout


def test_every_cluster_gets_its_own_random_secret_through_the_environment(monkeypatch):
    monkeypatch.delenv("TANDEM_CLUSTER_SECRET", raising=False)
    first, _, _ = children("--num-prefill", "2")
    second, _, _ = children("--num-prefill", "2")
    secrets_of = lambda kids: {c.env["TANDEM_CLUSTER_SECRET"] for c in kids}  # noqa: E731
    assert len(secrets_of(first)) == 1 and len(secrets_of(second)) == 1
    (a,), (b,) = secrets_of(first), secrets_of(second)
    assert a != b and len(a) == 32
    assert all(a not in " ".join(c.argv) for c in first)
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", "given-by-the-operator")
    assert secrets_of(children()[0]) == {"given-by-the-operator"}


def test_the_base_fraction_is_read_as_the_servers_read_it(monkeypatch):
    monkeypatch.delenv("TANDEM_MEM_FRACTION_STATIC", raising=False)
    assert base_fraction(["--port", "1"]) == 0.85
    assert base_fraction(["--mem-fraction-static", "0.5"]) == 0.5
    assert base_fraction(["--mem-fraction-static=0.6", "--dtype", "bfloat16"]) == 0.6
    monkeypatch.setenv("TANDEM_MEM_FRACTION_STATIC", "0.7")
    assert base_fraction([]) == 0.7 and base_fraction(["--mem-fraction-static=0.4"]) == 0.4


@pytest.mark.parametrize("mode", ["pd", "monolithic"])
def test_api_key_reaches_every_process_through_its_environment_not_its_argv(mode):
    kids, _, _ = children("--mode", mode, "--num-decode", "2", "--api-key", "k-123")
    assert len(kids) == (4 if mode == "pd" else 1)
    assert all(c.env["TANDEM_API_KEY"] == "k-123" and "k-123" not in " ".join(c.argv) for c in kids)


def test_prefill_and_decode_tp_sizes_reach_their_servers():
    p = argparse.ArgumentParser()
    add_up_flags(p)
    ns = p.parse_args(["--device", "cpu", "--num-decode", "2", "--prefill-tp-size", "1", "--decode-tp-size", "3"])
    by_name = {c.name: c for c in plan_children(ns)}
    tp_of = lambda c: c.argv[c.argv.index("--tp-size") + 1]  # noqa: E731
    assert [tp_of(by_name[n]) for n in ("prefill-0", "decode-0", "decode-1")] == ["1", "3", "3"]
    for args, error in (
        (["--device", "cpu", "--", "--tp-size", "2"], "--tp-size after --: give `tandem up --prefill-tp-size A"),
        (
            ["--device", "cuda", "--decode-tp-size", "2"],
            "tandem up gives each server one GPU, and a server at --tp-size N needs N",
        ),
    ):
        ns = p.parse_args(args)
        with pytest.raises(UserError, match=error):
            check_up(ns, plan_children(ns))


def test_kv_aware_turns_on_every_engines_events_and_sets_the_routers_policy():
    kids, by_name, engines = children("--num-prefill", "2", "--policy", "kv_aware", "--", "--page-size", "4")
    for c in engines:
        at = c.argv.index("--kv-events-config")
        assert json.loads(c.argv[at + 1]) == {
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
        }
        assert c.argv[-2:] == ["--page-size", "4"]  # the user's flags stay last
    assert by_name["router"].argv[-2:] == ["--policy", "kv_aware"]
    _, plain, _ = children()
    assert "--kv-events-config" not in plain["decode-0"].argv and plain["router"].argv[-1] == "cache_aware"
    _, by_name, _ = children("--decode-policy", "kv_aware")
    assert "--kv-events-config" in by_name["decode-0"].argv
    assert by_name["router"].argv[-4:] == ["--policy", "cache_aware", "--decode-policy", "kv_aware"]


def test_cost_placement_turns_on_events_and_a_planner_makes_every_engine_switchable():
    _, by_name, engines = children("--num-decode", "2", "--pd-placement", "cost", "--planner", "sla")
    assert by_name["router"].argv[-2:] == ["--pd-placement", "cost"]
    assert all("--kv-events-config" in c.argv and "--enable-pd-role-switch" in c.argv for c in engines)
    boots = [c.argv[c.argv.index("--bootstrap-port") + 1] for c in engines]
    assert boots == ["8998", "8999", "9000"]  # the prefill's, then one per decode for when it is a prefill
    planner = by_name["planner"].argv
    assert planner[planner.index("planner") :][:5] == ["planner", "--router", "http://127.0.0.1:8000", "--mode", "sla"]
    _, plain, _ = children()
    assert "planner" not in plain and "--enable-pd-role-switch" not in plain["decode-0"].argv


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--mode", "monolithic", "--policy", "kv_aware"), "needs --mode pd"),
        (("--policy", "kv_aware", "--", "--kv-events-config", "{}"), "sets it on every server"),
        (("--mode", "monolithic", "--decode-policy", "kv_aware"), "^--decode-policy kv_aware: .* needs --mode pd"),
    ],
)
def test_kv_aware_refuses_what_contradicts_it(args, says):
    from common.wire.user_error import UserError
    from tandem.up import check_up

    ns = argparse.ArgumentParser()
    add_up_flags(ns)
    parsed = ns.parse_args(["--device", "cpu", *args])
    with pytest.raises(UserError, match=says):
        check_up(parsed, plan_children(parsed))


def test_up_with_a_mooncake_store_runs_tandem_kv_store_and_points_every_server_at_it():
    kids, by_name, _ = children("--hicache-storage-backend", "mooncake", "--kv-store-port", "41000")
    store = by_name["kv-store"]
    assert store.argv[3:] == [
        "kv-store",
        "--host",
        "127.0.0.1",
        "--port",
        "41000",
        "--metadata-port",
        "41001",
        "--metrics-port",
        "41002",
        "--client-port",
        "41003",
        "--size",
        "4GB",
    ]
    assert store.health_url == "http://127.0.0.1:41002/health" and kids[0] is store
    extra = json.dumps(
        {"master_server_address": "127.0.0.1:41000", "metadata_server": "http://127.0.0.1:41001/metadata"}
    )
    for name in ("prefill-0", "decode-0"):
        argv = by_name[name].argv
        assert argv[argv.index("--hicache-storage-backend") + 1] == "mooncake" and "--enable-hierarchical-cache" in argv
        assert argv[argv.index("--hicache-storage-backend-extra-config") + 1] == extra
        assert "--hicache-storage-prefetch-policy" not in argv  # a server with a store waits for it by default
    kids, by_name, _ = children("--mode", "monolithic", "--hicache-storage-backend", "file")
    assert [c.name for c in kids] == ["server"] and "--hicache-storage-backend" in by_name["server"].argv


@pytest.mark.parametrize("backend", TRANSFER_BACKENDS)
def test_every_transfer_backend_up_offers_reaches_servers_that_accept_it(backend):
    """One list (common.wire.kv_layout.TRANSFER_BACKENDS) for `tandem up` and the servers' config."""
    _, _, engines = children("--transfer-backend", backend)
    for child in engines:
        assert child.argv[child.argv.index("--transfer-backend") + 1] == backend
    assert ServerConfig(transfer_backend=backend).transfer_backend == backend


def test_up_refuses_the_loopback_backend_of_unit_tests(capsys):
    with pytest.raises(SystemExit):
        children("--transfer-backend", "loopback")
    assert "invalid choice: 'loopback'" in capsys.readouterr().err


def test_lora_flags_reach_every_engine_server_and_not_the_router():
    pinned = json.dumps({"lora_name": "p", "lora_path": "/a/p", "pinned": True})
    args = ("--enable-lora", "--lora-paths", "x=/a/x", pinned, "--max-loras-per-batch", "4", "--max-lora-rank", "16")
    _, by_name, engines = children(*args, "--lora-target-modules", "q_proj", "v_proj")
    want = ["--enable-lora", "--lora-paths", "x=/a/x", pinned, "--max-loras-per-batch", "4", "--max-lora-rank", "16"]
    want += ["--lora-target-modules", "q_proj", "v_proj"]
    for c in engines:
        i = c.argv.index("--enable-lora")
        assert c.argv[i : i + len(want)] == want, c.name
    assert "--enable-lora" not in by_name["router"].argv

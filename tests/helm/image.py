"""The images docker/build.sh builds, in a buildah store kept under .cache/images (git-ignored: its layers are
the cache a later run reuses), and commands run in a working container of one with `buildah run --isolation
chroot --network host`, as the image's own user, the way a pod's container runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import ROOT, ServerProcess

STORE = ROOT / ".cache" / "images"
BUILD_TIMEOUT_S = 1500  # a cold build: debootstrap, Debian's packages, setup.sh's downloads (performance.md)


def cannot_build() -> str | None:
    """Why docker/build.sh cannot run here (a reason to skip), or None."""
    if sys.platform != "linux":
        return "buildah builds Linux images on Linux only"
    if os.geteuid() != 0:
        return "docker/build.sh runs debootstrap and buildah (chroot isolation) as root"
    if not shutil.which("buildah") and not shutil.which("apt-get"):
        return "no buildah, and no apt-get to install it with"
    return None


def store_flags() -> list[str]:
    """buildah's flags for the tests' store, with the storage driver it was made with (build.sh's choice)."""
    driver = "overlay" if (STORE / "storage" / "overlay-images").is_dir() else "vfs"
    return ["--storage-driver", driver, "--root", str(STORE / "storage"), "--runroot", str(STORE / "run")]


def buildah(*args: str, timeout: float = 120, check: bool = True) -> str:
    """A buildah command on the tests' store; its stdout."""
    out = subprocess.run(["buildah", *store_flags(), *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 or not check, f"buildah {' '.join(args)}: {out.stderr}"
    return out.stdout


BUILDS: dict[str, subprocess.Popen] = {}  # docker/build.sh runs started by start_build, by device


def start_build(device: str) -> None:
    """docker/build.sh `device` started now, in the background at a lower priority: most of a cold build's
    minutes are downloads and disk writes, which then overlap the suite's CPU-bound tests (tests/conftest.py
    starts it when the image test is selected and runs that test last); build() waits for it."""
    log = STORE.parent / f"image-build-{device}.log"
    STORE.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"TANDEM_IMAGE_ROOT": str(STORE)}
    with open(log, "w") as f:
        BUILDS[device] = subprocess.Popen(
            ["nice", "-n", "10", "bash", "docker/build.sh", device], cwd=ROOT, env=env, stdout=f,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def stop_builds() -> None:
    """Kill the background builds still running (a run that ended before its image test)."""
    for proc in BUILDS.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    BUILDS.clear()


def build(device: str) -> str:
    """docker/build.sh's build into the tests' store (the one start_build began, else one started now); its
    output (the log of what it did)."""
    if device not in BUILDS:
        start_build(device)
    proc = BUILDS.pop(device)
    code = proc.wait(timeout=BUILD_TIMEOUT_S)
    text = (STORE.parent / f"image-build-{device}.log").read_text(errors="replace")
    assert code == 0, f"docker/build.sh {device} exited with {code}:\n" + "\n".join(text.splitlines()[-40:])
    return text


@contextmanager
def working_container(image: str) -> Iterator[str]:
    """A working container of `image` (its own copy of the file system), removed after."""
    name = "tandem-test"
    buildah("rm", name, timeout=300, check=False)  # one a killed run left
    buildah("from", "--name", name, image, timeout=600)
    try:
        yield name
    finally:
        buildah("rm", name, timeout=300)


def run_in(ctr: str, *command: str) -> str:
    """`command` in the container, as the image's user; its stdout."""
    return buildah("run", "--isolation", "chroot", "--network", "host", ctr, "--", *command)


class ImageProcess(ServerProcess):
    """A server in a working container: `tandem <args>` (the image's entry point, as a pod's `command` runs
    it) with `env` set in the container, on the host's network (its ports are the host's). A SIGTERM to buildah
    stops the server; a SIGKILL would leave it running, so buildah leads a session of its own, killed whole."""

    entry = ("tandem",)

    def __init__(self, ctr: str, args: list[str], port: int, env: dict[str, str] | None = None, **kw):
        flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
        run = ("run", "--isolation", "chroot", "--network", "host", *flags, ctr, "--")
        super().__init__(args, port, env=env, prefix=("setsid", "buildah", *store_flags(), *run), **kw)

    def stop(self) -> None:
        super().stop()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def image_size(image: str) -> str:
    return buildah("images", "--format", "{{.Size}}", image).strip()


def image_config(image: str) -> dict:
    """The image's OCI config (User, Entrypoint, Cmd, Env, ...)."""
    return json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]


def rootfs(ctr: str) -> Path:
    """The container's file system, mounted on the host (buildah keeps it mounted until the container goes)."""
    return Path(buildah("mount", ctr).strip())

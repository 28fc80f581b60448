"""The CPU image the chart names, built by the project (docker/build.sh: buildah, a debootstrapped Debian,
scripts/setup.sh; no container registry), runs the CPU demo's rendered prefill, decode and router commands
inside it, as its non-root user, and serves a chat completion equal to a monolithic server's on the host.

A cold build takes minutes (docs/performance.md); its layers stay in .cache/images for the next run."""

from __future__ import annotations

import functools

import httpx
import pytest

from tests.conftest import free_port
from tests.helm.chart import container, example, render
from tests.helm.image import (
    ImageProcess,
    build,
    cannot_build,
    image_config,
    image_size,
    rootfs,
    run_in,
    working_container,
)
from tests.helm.pods import process

CHAT = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
    "logprobs": True,
}
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "x86_64-linux-gnu-gcc-12")


def chat(url: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(completion: dict) -> list[tuple[str, float]]:
    return [(t["token"], t["logprob"]) for t in completion["choices"][0]["logprobs"]["content"]]


def assert_lean(root) -> None:
    """No compiler, no pip or apt cache, nothing left of the host's wheels mounted at /mnt for the build."""
    assert [c for c in COMPILERS if (root / "usr/bin" / c).exists()] == []
    assert not (root / "root/.cache").exists() and not (root / "home/tandem/.cache").exists()
    assert [p.name for p in (root / "var/lib/apt/lists").glob("*") if p.is_file() and p.name != "lock"] == []
    assert list((root / "var/cache/apt/archives").glob("*.deb")) == []
    assert list((root / "mnt").iterdir()) == []


@pytest.mark.timeout(1800)
def test_the_cpu_image_serves_the_cpu_demo_as_the_chart_runs_it(reference_servers):
    reason = cannot_build()
    if reason:
        pytest.skip(reason)
    docs = render(example("cpu-demo.yaml"))
    image = container(docs, "prefill")["image"]
    assert {container(docs, r)["image"] for r in ("prefill", "decode", "router")} == {image}
    log = build("cpu")
    assert f"[image] built {image} in " in log and image_size(image), log[-2000:]  # the name the chart runs
    config = image_config(image)
    assert config["User"] == "1000" and config["Entrypoint"] == ["tandem"]  # a uid: runAsNonRoot can check it
    expected = chat(reference_servers.get("--model", "builtin").url)
    p_http, p_boot, d_http, r_http = free_port(), free_port(), free_port(), free_port()
    servers = []
    with working_container(image) as ctr:
        assert run_in(ctr, "id", "-un").strip() == "tandem"
        assert_lean(rootfs(ctr))
        spawn = functools.partial(ImageProcess, ctr)
        try:
            servers.append(
                process(docs, "prefill", {"--port": str(p_http), "--bootstrap-port": str(p_boot)}, p_http, spawn=spawn)
            )
            servers.append(process(docs, "decode", {"--port": str(d_http)}, d_http, spawn=spawn))
            for s in servers:
                s.wait_ready()
            flags = {
                "--port": str(r_http),
                "--prefill-bootstrap-port": str(p_boot),
                "--prefill-discovery": f"localhost:{p_http}",
                "--decode-discovery": f"localhost:{d_http}",
            }
            servers.append(process(docs, "router", flags, r_http, health="/readiness", spawn=spawn).wait_ready(60))
            out = chat(servers[-1].url)
            assert out["choices"][0]["message"] == expected["choices"][0]["message"]
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # PD adds where the cached tokens were
            assert [out["usage"][k] for k in counts] == [expected["usage"][k] for k in counts]
            got, want = (tokens(o) for o in (out, expected))
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
        finally:
            for s in reversed(servers):
                s.stop()

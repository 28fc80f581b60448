"""DeepSeek-V3 (MLA latent pool) with an FP8 KV cache across PD: the latent crosses the wire over
Mooncake and NIXL, and the tokens equal the monolithic server's with the same FP8 cache, token for token,
with chunked prefill."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import start_server
from tests.integration.cluster import generate, start_cluster
from tests.integration.moe_models import save_family
from tests.integration.test_architectures import VOCAB

STARTUP_LINE = "KV cache: MLA, float8_e4m3fn, per-tensor scales 1.0 (the checkpoint has none)"


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> tuple[str, ...]:
    path = save_family(tmp_path_factory.mktemp("deepseek-v3"), "deepseek_v3")
    return ("--model", str(path), "--page-size", "4", "--chunked-prefill-size", "16", "--kv-cache-dtype", "fp8_e4m3")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 37, 90)]


@pytest.fixture(scope="module")
def expected(flags, prompts) -> list[list[int]]:
    mono = start_server(*flags, name="mono-mla-fp8").wait_ready()
    try:
        assert STARTUP_LINE in mono.log_path.read_text()
        return [generate(mono.url, p, max_new=16)["output_ids"] for p in prompts]
    finally:
        mono.stop()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_pd_with_fp8_latent_equals_monolithic(flags, prompts, expected, backend):
    c = start_cluster(backend, flags=flags)
    try:
        assert all(STARTUP_LINE in n.log_path.read_text() for n in c.nodes)
        for ids, want in zip(prompts, expected):
            assert generate(c.url, ids, max_new=16)["output_ids"] == want, f"prompt of {len(ids)} tokens diverged"
        c.wait_idle()
    finally:
        c.stop()

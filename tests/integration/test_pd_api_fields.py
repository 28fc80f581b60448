"""Fields that change the tokens through a PD cluster (tiny model, Mooncake TCP, router): logit_bias and
min_new_tokens act on the first token too, which the prefill samples, so the output equals a monolithic
server's token for token; a worker called without the router's bootstrap fields is a 400 before
anything is scheduled."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import generate, start_cluster
from tests.integration.tiny_model import VOCAB, random_prompts

FLAGS = ("--page-size", "4", "--chunked-prefill-size", "32")
PROMPTS = random_prompts(3, 12, 30, seed=5)
EOS = VOCAB - 1


@pytest.fixture(scope="module")
def mono(tiny_model_dir, reference_servers):
    return reference_servers.get("--model", str(tiny_model_dir), *FLAGS)  # test_soak.py's


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = start_cluster("mooncake", flags=("--model", str(tiny_model_dir), *FLAGS))
    yield c
    c.stop()


def both(mono, cluster, ids: list[int], new: int, **sampling) -> tuple[list[int], list[int]]:
    return tuple(generate(url, ids, new, sampling=sampling)["output_ids"] for url in (mono.url, cluster.url))


def test_logit_bias_on_the_first_token_equals_monolithic(mono, cluster):
    for ids in PROMPTS:
        first = generate(mono.url, ids, 1, sampling={"ignore_eos": True})["output_ids"][0]
        want, got = both(mono, cluster, ids, 6, ignore_eos=True, logit_bias={str(first): -100})
        assert got == want and want[0] != first
    cluster.wait_idle()


def test_min_new_tokens_masks_a_stop_token_the_prefill_would_sample(mono, cluster):
    for ids in PROMPTS:
        free = generate(mono.url, ids, 6, sampling={"ignore_eos": True})["output_ids"]
        stop = {"stop_token_ids": [free[0]], "ignore_eos": True}
        assert both(mono, cluster, ids, 6, **stop) == ([free[0]], [free[0]])  # the first token stops it
        want, got = both(mono, cluster, ids, 6, min_new_tokens=3, **stop)
        assert got == want and free[0] not in want[:3]
    cluster.wait_idle()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_called_without_bootstrap_fields_is_a_400_before_scheduling(cluster, role):
    node = (cluster.prefills if role == "prefill" else cluster.decodes)[0]
    before = node.log_path.read_text(errors="replace").count("failed: a ")
    for path, body in [
        ("/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}),
    ]:
        r = httpx.post(node.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "bootstrap_room", 400)
        assert err["message"] == (
            f"a {role} server needs bootstrap_room (and the other bootstrap fields): send requests through the router"
        )
    assert node.log_path.read_text(errors="replace").count("failed: a ") == before  # the role never saw them
    cluster.wait_idle()

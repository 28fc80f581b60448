"""`python -m tandem bench` as a user runs it, against real monolithic servers on 127.0.0.1: the JSON
it writes is checked exactly where it can be (request and token counts), the rest for sense."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import ROOT, ServerProcess, free_port, start_server

LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")


@pytest.fixture(scope="module")
def server():
    s = start_server(name="bench").wait_ready()
    yield s
    s.stop()


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem", "bench", "--disable-tqdm", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def bench_json(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    r = bench(*args, "--output-json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def assert_latencies_make_sense(run: dict) -> None:
    for name in LATENCIES:
        p50, p90, p99, mean = (run[f"{k}_{name}_ms"] for k in ("p50", "p90", "p99", "mean"))
        assert 0 < p50 <= p90 <= p99 and mean > 0, (name, run)
    assert run["p50_ttft_ms"] < run["p50_e2e_latency_ms"]


@pytest.mark.parametrize("backend", ["openai", "sglang", "openai-chat"])
def test_counts_are_what_was_asked(server: ServerProcess, tmp_path, backend):
    doc = bench_json(
        tmp_path,
        "--backend",
        backend,
        "--base-url",
        server.url,
        "--num-prompts",
        "6",
        "--random-input-len",
        "24",
        "--random-output-len",
        "5",
        "--max-concurrency",
        "3",
        "--request-rate",
        "20",
        "--seed",
        "11",
        "--goodput",
        "ttft:60000",
        "itl:60000",
    )
    [run] = doc["runs"]
    assert (
        run["label"],
        run["base_url"],
        run["backend"],
        run["model"],
        run["request_rate"],
        run["max_concurrency"],
    ) == (server.url, server.url, backend, "SmolLM2-135M-Instruct", 20.0, 3)
    assert (run["num_prompts"], run["completed"], run["failed"], run["total_output_tokens"]) == (6, 6, 0, 30)
    if backend == "openai-chat":  # text in a chat template: the server counts more tokens than the 24 asked
        assert run["prompt_format"] == "text" and run["total_input_tokens"] > 6 * 24
    else:
        assert run["prompt_format"] == "token_ids" and run["total_input_tokens"] == 6 * 24
    assert run["request_throughput"] == pytest.approx(6 / run["duration"])
    assert run["output_throughput"] == pytest.approx(30 / run["duration"])
    assert (run["request_goodput"], run["slo_attainment"]) == (pytest.approx(6 / run["duration"]), 1.0)
    assert_latencies_make_sense(run)
    assert doc["config"]["goodput"] == {"ttft": 60000.0, "itl": 60000.0} and "api_key" not in doc["config"]
    assert doc["comparisons"] == []


def test_compare_and_plot_a_sweep_of_a_prefix_cache_against_none(server: ServerProcess, tmp_path):
    """Shared-prefix workload, one request at a time: with the radix cache 2 groups x 2 later questions
    reuse their 64-token system prompt; without it nothing is reused."""
    plain = start_server("--disable-radix-cache", name="bench-no-cache").wait_ready()
    try:
        png = tmp_path / "bench.png"
        doc = bench_json(
            tmp_path,
            "--backend",
            "sglang",
            "--base-url",
            server.url,
            "--compare",
            plain.url,
            "--label",
            "radix",
            "--compare-label",
            "no-cache",
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "3",
            "--gsp-system-prompt-len",
            "64",
            "--gsp-question-len",
            "16",
            "--gsp-output-len",
            "3",
            "--max-concurrency",
            "1",
            "--request-rate",
            "16",
            "inf",
            "--seed",
            "12",
            "--plot",
            str(png),
        )
    finally:
        plain.stop()
    runs = doc["runs"]
    assert [(r["label"], r["base_url"], r["request_rate"]) for r in runs] == [
        ("radix", server.url, 16.0),
        ("no-cache", plain.url, 16.0),
        ("radix", server.url, "inf"),
        ("no-cache", plain.url, "inf"),
    ]
    for r in runs:
        assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (6, 0, 6 * 80, 6 * 3)
        assert_latencies_make_sense(r)
    assert [r["total_cached_tokens"] for r in runs[1::2]] == [0, 0]
    assert all(r["total_cached_tokens"] >= 2 * 2 * 64 for r in runs[::2])
    assert [(c["request_rate"], c["base_url"], c["compare_url"]) for c in doc["comparisons"]] == [
        (16.0, server.url, plain.url),
        ("inf", server.url, plain.url),
    ]
    for c, base, other in zip(doc["comparisons"], runs[::2], runs[1::2]):
        assert c["ratios"]["total_input_tokens"] == 1.0 and c["ratios"]["total_cached_tokens"] == 0.0
        assert c["ratios"]["p99_ttft_ms"] == other["p99_ttft_ms"] / base["p99_ttft_ms"]
    with Image.open(png) as image:
        image.verify()
        assert (image.format, image.size) == ("PNG", (1300, 900))


def test_a_workload_from_jsonl_with_details(server: ServerProcess, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(row)
            for row in [{"prompt": "The capital of France is", "output_len": 3}, {"prompt": "One, two, three,"}]
        )
        + "\n"
    )
    doc = bench_json(
        tmp_path,
        "--base-url",
        server.url,
        "--dataset-name",
        "jsonl",
        "--dataset-path",
        str(path),
        "--random-output-len",
        "2",
        "--warmup-requests",
        "0",
        "--output-details",
    )
    [run] = doc["runs"]
    assert [(r["output_len"], r["success"], len(r["itl"])) for r in run["requests"]] == [(3, True, 2), (2, True, 1)]
    assert run["total_output_tokens"] == 5


def test_mistakes_end_with_a_message_that_says_what_to_do():
    r = bench("--goodput", "ttfb:100")
    assert r.returncode == 2 and "argument --goodput: 'ttfb:100': the metric must be one of" in r.stderr
    r = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1")
    assert r.returncode == 1 and "cannot connect" in r.stderr and "--base-url" in r.stderr
    r = bench("--dataset-name", "jsonl")
    assert r.returncode == 1 and "--dataset-name jsonl needs --dataset-path FILE" in r.stderr


def test_multi_turn_conversations_grow_by_their_answers_and_hit_the_cache(server: ServerProcess, tmp_path):
    """3 conversations x 3 turns: turn k's prompt is turn k-1's prompt, its 4-token answer and 8 new
    tokens, so the lengths are exact; from turn 2 on the server's radix cache holds the history."""
    png = tmp_path / "turns.png"
    doc = bench_json(
        tmp_path,
        "--backend",
        "sglang",
        "--base-url",
        server.url,
        "--dataset-name",
        "multi-turn",
        "--num-prompts",
        "3",
        "--mt-num-turns",
        "3",
        "--mt-turn-input-len",
        "8",
        "--mt-think-time-s",
        "0.05",
        "--random-input-len",
        "40",
        "--random-output-len",
        "4",
        "--request-rate",
        "10",
        "--seed",
        "13",
        "--plot",
        str(png),
    )
    [run] = doc["runs"]
    assert (run["num_prompts"], run["completed"], run["failed"], run["total_output_tokens"]) == (9, 9, 0, 36)
    turns = run["turns"]
    assert [(t["turn"], t["completed"], t["failed"]) for t in turns] == [(1, 3, 0), (2, 3, 0), (3, 3, 0)]
    assert [t["input_tokens"] for t in turns] == [3 * 40, 3 * 52, 3 * 64]
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] >= 3 * 32 for t in turns[1:])
    assert all(0 < t["p50_ttft_ms"] <= t["p99_ttft_ms"] for t in turns)
    with Image.open(png) as image:
        image.verify()
        assert (image.format, image.size) == ("PNG", (1300, 1350))

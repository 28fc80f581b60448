"""The flags of `tandem bench`, named as SGLang's bench_serving and vLLM's benchmark_serving name them."""

from __future__ import annotations

import argparse
import json
import math
import os

BACKENDS = ("openai", "openai-chat", "sglang")
DATASETS = ("random", "sharegpt", "jsonl", "generated-shared-prefix", "multi-turn")
SLO_METRICS = ("ttft", "itl", "tpot", "e2e_latency")


def positive_number(text: str) -> float:
    """A number > 0; `inf` too (a request rate of inf sends every request at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0 (or inf)")
    return value


def slo(text: str) -> tuple[str, float]:
    """`METRIC:MS`, e.g. `ttft:500`: one service-level objective of --goodput."""
    name, _, value = text.partition(":")
    if name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the metric must be one of {', '.join(SLO_METRICS)} (as in ttft:500)"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give milliseconds after the colon, as in {name}:500") from None
    if not (ms >= 0 and math.isfinite(ms)):
        raise argparse.ArgumentTypeError(f"{text!r}: the objective must be a finite number of ms >= 0")
    return name, ms


def int_at_least(low: int):
    """An argparse type: an integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {low}")
        return value

    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def seconds(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds >= 0")
    return value


def fraction(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be between 0 and 1")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); give an object such as '{{\"temperature\": 0.7}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object such as '{\"temperature\": 0.7}'")
    return value


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `tandem bench`."""
    _endpoint_flags(p.add_argument_group("endpoint"))
    _workload_flags(p.add_argument_group("workload"))
    _load_and_output_flags(p.add_argument_group("load and output"))


def _endpoint_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions; sglang: /generate with input_ids",
    )
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the endpoint under test")
    g.add_argument(
        "--compare",
        metavar="URL",
        default=None,
        help="a second endpoint: the same requests at the same arrival times, ratios side by side",
    )
    g.add_argument(
        "--label", default=None, help="the endpoint's name in the table, JSON and plots [default: --base-url]"
    )
    g.add_argument("--compare-label", default=None, help="the --compare endpoint's name [default: its URL]")
    g.add_argument("--model", default=None, help="model name sent in requests [default: the first of GET /v1/models]")
    g.add_argument(
        "--tokenizer",
        default="builtin",
        help="'builtin', a directory with tokenizer.json, a .gguf file or a Hub name: makes the prompts' token ids",
    )
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token [env OPENAI_API_KEY]")
    g.add_argument(
        "--request-timeout-s", type=positive_number, default=600.0, help="a request still streaming after this fails"
    )


def _workload_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random: --random-* lengths; sharegpt: ShareGPT-like length mix generated locally; "
        "jsonl: prompts of --dataset-path; generated-shared-prefix: --gsp-* groups sharing a system prompt; "
        "multi-turn: --num-prompts conversations of --mt-* turns, each turn's prompt the last one's prompt, "
        "answer and new tokens (first prompt --random-input-len, answers --random-output-len)",
    )
    g.add_argument("--dataset-path", default=None, help='jsonl: one {"prompt": str, "output_len": int?} per line')
    g.add_argument(
        "--num-prompts",
        type=int_at_least(1),
        default=64,
        help="requests per run (not generated-shared-prefix); multi-turn: conversations",
    )
    g.add_argument("--random-input-len", type=int_at_least(1), default=256, help="prompt tokens")
    g.add_argument(
        "--random-output-len",
        type=int_at_least(1),
        default=64,
        help="output tokens (random; jsonl lines without output_len)",
    )
    g.add_argument(
        "--random-range-ratio",
        type=fraction,
        default=1.0,
        help="lengths uniform in [ratio*len, len]; 1.0 = every request exactly len",
    )
    g.add_argument("--sharegpt-output-len", type=int_at_least(1), default=None, help="sharegpt: fixed output length")
    g.add_argument("--sharegpt-context-len", type=int_at_least(8), default=2048, help="sharegpt: prompt+output at most")
    g.add_argument("--gsp-num-groups", type=int_at_least(1), default=4, help="system prompts")
    g.add_argument("--gsp-prompts-per-group", type=int_at_least(1), default=8, help="questions per system prompt")
    g.add_argument("--gsp-system-prompt-len", type=int_at_least(1), default=512)
    g.add_argument("--gsp-question-len", type=int_at_least(1), default=32)
    g.add_argument("--gsp-output-len", type=int_at_least(1), default=32)
    g.add_argument("--mt-num-turns", type=int_at_least(1), default=4, help="multi-turn: turns per conversation")
    g.add_argument(
        "--mt-turn-input-len", type=int_at_least(1), default=32, help="multi-turn: new tokens per later turn"
    )
    g.add_argument(
        "--mt-think-time-s",
        type=seconds,
        default=0.0,
        help="multi-turn: seconds between an answer and the conversation's next turn",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=1,
        help="prompts, lengths and arrival times; another seed avoids the cache an earlier run left",
    )
    g.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    g.add_argument(
        "--extra-request-body", type=json_object, default={}, metavar="JSON", help="merged into every request body"
    )


def _load_and_output_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--request-rate",
        type=positive_number,
        nargs="+",
        default=[math.inf],
        metavar="RATE",
        help="requests/s, Poisson arrivals; several values = a sweep; inf = all at once",
    )
    g.add_argument("--max-concurrency", type=int_at_least(1), default=None, help="requests in flight at most")
    g.add_argument("--warmup-requests", type=int_at_least(0), default=1, help="unmeasured requests before each run")
    g.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 itl:100 (itl: a request's longest gap)",
    )
    g.add_argument("--output-json", default=None, metavar="FILE", help="write every run's results as JSON")
    g.add_argument("--output-details", action="store_true", help="also each request's lengths, TTFT, ITLs, error")
    g.add_argument("--plot", default=None, metavar="PNG", help="latency percentiles vs request rate, TTFT/ITL CDFs")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

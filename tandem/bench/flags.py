"""The flags of `tandem bench`, named as SGLang's bench_serving and vLLM's benchmark_serving name them."""
from __future__ import annotations

import argparse
import json
import math
import os

BACKENDS = ("openai", "openai-chat", "sglang")
DATASETS = ("random", "sharegpt", "jsonl", "generated-shared-prefix")
SLO_METRICS = ("ttft", "itl", "tpot", "e2e_latency")


def request_rate(text: str) -> float:
    """A positive number of requests/s, or `inf` (every request at time 0)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give requests/s such as 4, or inf") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the rate must be > 0 (or inf)")
    return rate


def slo(text: str) -> tuple[str, float]:
    """`METRIC:MS`, e.g. `ttft:500`: one service-level objective of --goodput."""
    name, _, value = text.partition(":")
    if name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"{text!r}: the metric must be one of {', '.join(SLO_METRICS)} (as in ttft:500)")
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


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
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
    target = p.add_argument_group("endpoint")
    target.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions; sglang: /generate with input_ids")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="the endpoint under test")
    target.add_argument("--compare", metavar="URL", default=None,
                        help="a second endpoint: the same requests at the same arrival times, ratios side by side")
    target.add_argument("--model", default=None, help="model name sent in requests [default: the first of GET /v1/models]")
    target.add_argument("--tokenizer", default="builtin",
                        help="HF directory, .gguf file, Hub name or 'builtin': makes the prompts' token ids")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token [env OPENAI_API_KEY]")
    target.add_argument("--request-timeout-s", type=float, default=600.0, help="a request still streaming after this fails")

    data = p.add_argument_group("workload")
    data.add_argument("--dataset-name", choices=DATASETS, default="random",
                      help="random: --random-* lengths; sharegpt: ShareGPT-like length mix generated locally; "
                      "jsonl: prompts of --dataset-path; generated-shared-prefix: --gsp-* groups sharing a system prompt")
    data.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\": str, \"output_len\": int?} per line")
    data.add_argument("--num-prompts", type=int_at_least(1), default=64, help="requests per run (not generated-shared-prefix)")
    data.add_argument("--random-input-len", type=int_at_least(1), default=256, help="prompt tokens")
    data.add_argument("--random-output-len", type=int_at_least(1), default=64,
                      help="output tokens (random; jsonl lines without output_len)")
    data.add_argument("--random-range-ratio", type=fraction, default=1.0,
                      help="lengths uniform in [ratio*len, len]; 1.0 = every request exactly len")
    data.add_argument("--sharegpt-output-len", type=int_at_least(1), default=None, help="sharegpt: fixed output length")
    data.add_argument("--sharegpt-context-len", type=int_at_least(8), default=2048, help="sharegpt: prompt+output at most")
    data.add_argument("--gsp-num-groups", type=int_at_least(1), default=4, help="system prompts")
    data.add_argument("--gsp-prompts-per-group", type=int_at_least(1), default=8, help="questions per system prompt")
    data.add_argument("--gsp-system-prompt-len", type=int_at_least(1), default=512)
    data.add_argument("--gsp-question-len", type=int_at_least(1), default=32)
    data.add_argument("--gsp-output-len", type=int_at_least(1), default=32)
    data.add_argument("--seed", type=int, default=1,
                      help="prompts, lengths and arrival times; another seed avoids the cache an earlier run left")
    data.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    data.add_argument("--extra-request-body", type=json_object, default={}, metavar="JSON", help="merged into every request body")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=request_rate, nargs="+", default=[math.inf], metavar="RATE",
                      help="requests/s, Poisson arrivals; several values = a sweep; inf = all at once")
    load.add_argument("--max-concurrency", type=int_at_least(1), default=None, help="requests in flight at most")
    load.add_argument("--warmup-requests", type=int_at_least(0), default=1, help="unmeasured requests before each run")
    load.add_argument("--goodput", type=slo, nargs="+", default=[], metavar="METRIC:MS",
                      help="SLOs for goodput, e.g. ttft:500 itl:100 (itl: a request's longest gap)")

    out = p.add_argument_group("output")
    out.add_argument("--output-json", default=None, metavar="FILE", help="write every run's results as JSON")
    out.add_argument("--output-details", action="store_true", help="also each request's lengths, TTFT, ITLs, error")
    out.add_argument("--plot", default=None, metavar="PNG", help="latency percentiles vs request rate, TTFT/ITL CDFs")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

"""The requests of a run: prompts as token ids (so their lengths are exact) and output lengths, from
a seeded generator or a JSONL file. The same seed gives the same requests on every endpoint."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tandem.bench.tokenizer import ordinary_token_ids

# ShareGPT-like mix: log-normal lengths whose means (~200 prompt, ~200 output tokens) and long tails
# resemble the ShareGPT conversations SGLang and vLLM benchmark with, without downloading them.
SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA = 100, 1.2
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 120, 1.0


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    text: str  # the same prompt decoded, for endpoints that take text
    output_len: int


class Workload:
    """Builds requests from one tokenizer and seed."""

    def __init__(self, tokenizer: Tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.vocab = np.array(ordinary_token_ids(tokenizer))

    def random_ids(self, n: int) -> list[int]:
        return self.rng.choice(self.vocab, size=n).tolist()

    def request(self, ids: list[int], output_len: int) -> BenchRequest:
        return BenchRequest(ids, self.tokenizer.decode(ids), output_len)

    def lengths(self, n: int, length: int, ratio: float) -> list[int]:
        """n lengths uniform in [ratio*length, length]."""
        return self.rng.integers(max(1, int(length * ratio)), length + 1, size=n).tolist()

    def random(self, n: int, input_len: int, output_len: int, ratio: float) -> list[BenchRequest]:
        inputs, outputs = self.lengths(n, input_len, ratio), self.lengths(n, output_len, ratio)
        return [self.request(self.random_ids(i), o) for i, o in zip(inputs, outputs)]

    def sharegpt(self, n: int, context_len: int, output_len: int | None) -> list[BenchRequest]:
        """Log-normal lengths; each request's prompt + output fits `context_len`."""
        inputs = self.rng.lognormal(math.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA, size=n)
        outputs = self.rng.lognormal(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA, size=n)
        requests = []
        for i, o in zip(inputs, outputs):
            out = output_len or int(np.clip(o, 1, context_len // 2))
            requests.append(self.request(self.random_ids(int(np.clip(i, 4, context_len - out))), out))
        return requests

    def shared_prefix(
        self, groups: int, per_group: int, system_len: int, question_len: int, output_len: int
    ) -> list[BenchRequest]:
        """`groups` system prompts x `per_group` questions each, shuffled: the prefix cache's workload."""
        systems = [self.random_ids(system_len) for _ in range(groups)]
        requests = [
            self.request(s + self.random_ids(question_len), output_len) for s in systems for _ in range(per_group)
        ]
        return [requests[i] for i in self.rng.permutation(len(requests))]

    def jsonl(self, path: Path, n: int, default_output_len: int) -> list[BenchRequest]:
        """The first n lines of `path`, each {"prompt": str, "output_len": int (optional)}."""
        requests = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if len(requests) == n:
                break
            if line.strip():
                prompt, output_len = _jsonl_line(path, lineno, line, default_output_len)
                requests.append(self.request(self.tokenizer.encode(prompt, add_special_tokens=False).ids, output_len))
        if not requests:
            raise SystemExit(f"--dataset-path {path}: no prompts in the file")
        return requests


def _jsonl_line(path: Path, lineno: int, line: str, default_output_len: int) -> tuple[str, int]:
    where = f"--dataset-path {path}, line {lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{where}: not JSON ({e})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise SystemExit(f'{where}: needs a non-empty string field "prompt"')
    output_len = row.get("output_len", default_output_len)
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise SystemExit(f'{where}: "output_len" must be an integer >= 1')
    return row["prompt"], output_len


def build_workload(ns: argparse.Namespace, w: Workload) -> list[BenchRequest]:
    """The requests --dataset-name and its flags describe, drawn from `w` (new prompts at every call)."""
    if ns.dataset_name == "random":
        return w.random(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio)
    if ns.dataset_name == "sharegpt":
        return w.sharegpt(ns.num_prompts, ns.sharegpt_context_len, ns.sharegpt_output_len)
    if ns.dataset_name == "generated-shared-prefix":
        return w.shared_prefix(
            ns.gsp_num_groups,
            ns.gsp_prompts_per_group,
            ns.gsp_system_prompt_len,
            ns.gsp_question_len,
            ns.gsp_output_len,
        )
    if ns.dataset_path is None:
        raise SystemExit('--dataset-name jsonl needs --dataset-path FILE (one {"prompt": ...} per line)')
    path = Path(ns.dataset_path)
    if not path.is_file():
        raise SystemExit(f"--dataset-path {path}: no such file")
    return w.jsonl(path, ns.num_prompts, ns.random_output_len)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate` (the first at
    0), or all at 0 for rate inf. Seeded, so every endpoint of a --compare gets the same times."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()

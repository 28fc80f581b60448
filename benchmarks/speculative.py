"""Speculative decoding on the CPU with the built-in SmolLM2-135M: decode speed with and without speculation,
one request at a time and 16 at once, for NGRAM and for STANDALONE with a draft cut from the target (its
first --draft-layers layers and its head), on repetitive text (code, lists) and on open chat; accepted
drafts per verify for each. With --pd, the same NGRAM prompts through a PD pair (plain prefill, NGRAM decode,
Mooncake) against a monolithic NGRAM engine: drafts accepted on each.

Engines run in this process, one after another, with --threads torch threads (1 keeps a loaded machine's
numbers comparable: with 2 threads on 2 busy cores a small matmul can wait for the other thread's slice).

    .venv/bin/python benchmarks/speculative.py [--threads 1] [--new 128] [--draft-layers 6] [--pd]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.model.truncate import truncate_model  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402

REPETITIVE = [
    "def add_1(x):\n    return x + 1\n\ndef add_2(x):\n    return x + 2\n\ndef add_3(x):\n    return x + 3\n\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,",
    "<|im_start|>user\nList the days of the week, each on its own line, as 'Day N: name'.<|im_end|>\n"
    "<|im_start|>assistant\n",
    '{"users": [{"id": 1, "name": "user1", "active": true}, {"id": 2, "name": "user2", "active": true}, ',
]
CHAT = [
    "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
]


def run(engine: Engine, prompts: list[list[int]], new: int) -> tuple[list[Req], float]:
    """All prompts at once, greedy; the requests and the wall time."""
    reqs = [
        Req(f"b{i}", p, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    return reqs, time.perf_counter() - start


def per_verify(reqs: list[Req]) -> str:
    verifies = sum(r.spec_verify_ct for r in reqs)
    if not verifies:
        return "-"
    return f"{sum(r.spec_accepted for r in reqs) / verifies:.2f}"


class Tally:
    """One configuration's totals over the rounds: single-stream decode tokens and seconds (after each
    request's first token), batch tokens and seconds, and the requests (for accepted drafts per verify)."""

    def __init__(self) -> None:
        self.tokens = self.seconds = self.batch_tokens = self.batch_seconds = 0.0
        self.single: list[Req] = []
        self.batch: list[Req] = []

    def add_single(self, r: Req) -> None:
        self.tokens += len(r.output_ids) - 1
        self.seconds += r.last_token_time - r.first_token_time
        self.single.append(r)

    def add_batch(self, reqs: list[Req], seconds: float) -> None:
        self.batch_tokens += sum(len(r.output_ids) for r in reqs)
        self.batch_seconds += seconds
        self.batch += reqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=2, help="each measurement repeated, configs interleaved")
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--pd", action="store_true", help="also NGRAM through a PD pair")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    draft = truncate_model("builtin", ns.draft_layers, Path(tempfile.mkdtemp()) / f"draft{ns.draft_layers}")
    configs = {
        "off": {},
        "NGRAM k=3": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
        "NGRAM k=6": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 7},
        f"STANDALONE {ns.draft_layers}/30 layers k=3": {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": str(draft),
            "speculative_num_steps": 3,
        },
    }
    engines = {
        n: Engine(ServerConfig(model="builtin", page_size=16, max_total_tokens=8192, **f)) for n, f in configs.items()
    }
    tok = engines["off"].tokenizer
    texts = {"repetitive": REPETITIVE, "chat": CHAT}
    tallies = {(n, kind): Tally() for n in configs for kind in texts}
    for e in engines.values():
        run(e, [tok("warm up")["input_ids"]], 4)
    for _ in range(ns.rounds):  # every measurement runs each config back to back: a drifting load hits all alike
        for kind, batch_texts in texts.items():
            prompts = [tok(t)["input_ids"] for t in batch_texts]
            for p in prompts:
                for name, e in engines.items():
                    tallies[name, kind].add_single(run(e, [p], ns.new)[0][0])
            print(f"round done: {kind} single streams", flush=True)
            batch = [prompts[i % len(prompts)] for i in range(16)]
            for name, e in engines.items():
                tallies[name, kind].add_batch(*run(e, batch, ns.new))
    print(f"torch threads {ns.threads}, {ns.new} new tokens per request, greedy, {ns.rounds} rounds interleaved")
    print(
        f"{'config':<32} {'text':<11} {'1 stream tok/s':>14} {'x':>6} {'16 at once tok/s':>17} {'x':>6}  accepted/verify (1, 16)"
    )
    for (name, kind), t in tallies.items():
        base = tallies["off", kind]
        single, batch = t.tokens / t.seconds, t.batch_tokens / t.batch_seconds
        b1, b16 = base.tokens / base.seconds, base.batch_tokens / base.batch_seconds
        print(
            f"{name:<32} {kind:<11} {single:>14.1f} {single / b1:>6.2f} {batch:>17.1f} {batch / b16:>6.2f}"
            f"  {per_verify(t.single)}, {per_verify(t.batch)}"
        )
    if ns.pd:
        pd_accepts(tallies["NGRAM k=6", "repetitive"].single[: len(REPETITIVE)], ns.new)


def pd_accepts(mono: list[Req], new: int) -> None:
    """The same prompts through a PD pair whose decode runs NGRAM k=6: drafts accepted, against one engine."""
    from tests.integration.cluster import generate, start_cluster

    flags = ("--page-size", "16", "--max-total-tokens", "8192")
    ngram = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "7")
    cluster = start_cluster("mooncake", flags=flags, decode_flags=ngram)
    try:
        pd = [generate(cluster.url, r.prompt_ids, new, sampling={"ignore_eos": True}) for r in mono]
    finally:
        cluster.stop()
    same = all(o["output_ids"] == r.output_ids for o, r in zip(pd, mono))
    a_pd = sum(o["meta_info"]["spec_accepted_tokens"] for o in pd)
    v_pd = sum(o["meta_info"]["spec_verify_ct"] for o in pd)
    a_mono, v_mono = sum(r.spec_accepted for r in mono), sum(r.spec_verify_ct for r in mono)
    print(
        f"PD NGRAM k=6 (repetitive): accepted {a_pd} drafts in {v_pd} verifies ({a_pd / v_pd:.2f}); monolithic "
        f"{a_mono} in {v_mono} ({a_mono / v_mono:.2f}); difference {abs(a_pd - a_mono) / a_mono:.1%}; tokens equal: {same}"
    )


if __name__ == "__main__":
    main()

"""FP8 KV cache against the unquantized one on the built-in model (SmolLM2-135M, float32 on the CPU).

The unquantized engine generates 256 greedy tokens for each prompt; every engine then reads those
sequences back (teacher forcing: the prompt plus the 256 tokens as one prefill, chunked, every KV read
through its pool) and reports, over the 256 positions, how often its top-1 token is the reference token
and the mean |logprob difference| of the reference token against the unquantized cache.

    PYTHONPATH=. .venv/bin/python benchmarks/fp8_kv_accuracy.py [--tokens 256] [--prompts 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    ",
    "Here is a recipe for a simple tomato soup:",
    "Explain why the sky is blue to a child.",
]


def run(engine: Engine, reqs: list[Req]) -> list[Req]:
    for r in reqs:
        engine.scheduler.add_request(r)
    while engine.scheduler.step():
        pass
    return reqs


def reference(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return [r.output_ids for r in run(engine, [Req(f"g{i}", p, params) for i, p in enumerate(prompts)])]


def read_back(engine: Engine, prompts: list[list[int]], outs: list[list[int]]) -> list[tuple[list, list]]:
    """Per sequence, over the generated positions: (logprob of the reference token, top-1 token)."""
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    reqs = [
        Req(f"t{i}", p + o, params, return_logprob=True, top_logprobs_num=1, logprob_start_len=len(p) - 1)
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]
    run(engine, reqs)
    return [
        (r.input_logprobs[len(p) :], [t[0][0] for t in r.input_top_logprobs[len(p) :]]) for r, p in zip(reqs, prompts)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    texts = PROMPTS[: args.prompts]
    results, ref_outs, prompts = {}, None, None
    for kv in ("auto", "fp8_e4m3", "fp8_e5m2"):
        engine = Engine(ServerConfig(kv_cache_dtype=kv, max_total_tokens=8192, chunked_prefill_size=128))
        if ref_outs is None:
            prompts = [engine.tokenizer.encode(p) for p in texts]
            ref_outs = reference(engine, prompts, args.tokens)
            print("reference generated", file=sys.stderr, flush=True)
        results[kv] = read_back(engine, prompts, ref_outs)
        print(f"{kv} read back", file=sys.stderr, flush=True)
        engine.stop()
    base = results["auto"]
    print(f"| KV cache | top-1 agreement ({len(texts)} x {args.tokens} tokens) | mean abs logprob diff |")
    print("|---|---|---|")
    for kv, seqs in results.items():
        agree = total = 0
        diffs = []
        for (lps, tops), (base_lps, _), out in zip(seqs, base, ref_outs):
            agree += sum(t == o for t, o in zip(tops, out))
            total += len(out)
            diffs += [abs(a - b) for a, b in zip(lps, base_lps)]
        print(f"| {kv} | {agree / total:.4f} ({agree}/{total}) | {sum(diffs) / len(diffs):.5f} |")


if __name__ == "__main__":
    main()

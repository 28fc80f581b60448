"""What constrained decoding costs: the decode step with every request constrained by a JSON schema against
the same step unconstrained, at several batch sizes (the bitmask: one matcher fill per row on the host, then
xgrammar's kernel over the logits), and the compile time of a typical tool schema, cold and cached.

    .venv/bin/python benchmarks/grammar_bench.py [--batches 1 16 64] [--steps 20] [--mask-only]

--mask-only times the bitmask alone (every row's matcher fill and the kernel over [batch, vocab] logits) and
the compilation, without running the model: what the grammar adds to a step, whatever the step costs.

The built-in model on this machine's device. Each request is held in the decode batch (the schema's array
of strings never has to end; unconstrained rows ignore EOS), and the steady-state step is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
from common.wire.structured_output import GrammarSpec, canonical_json

LONG = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}
TOOL = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include": {"type": "array", "items": {"type": "string", "enum": ["wind", "rain", "uv"]}, "maxItems": 3},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}


def step_ms(engine: Engine, batch: int, steps: int, constrained: bool) -> float:
    """Median wall time of a decode step of `batch` requests, after the prefill and two warm-up steps."""
    ids = engine.tokenizer.encode("Write notes about Paris as JSON:")
    spec = GrammarSpec("json_schema", canonical_json(LONG, "schema"), "schema") if constrained else None
    params = SamplingParams(max_new_tokens=steps + 40, temperature=0, ignore_eos=True)
    reqs = [Req(f"r{i}", ids, params, grammar_spec=spec) for i in range(batch)]
    s = engine.scheduler
    for r in reqs:
        s.add_request(r)
    while len(s.decode.running) < batch:
        s.step()
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        s.step()
        if i >= 2:
            times.append(time.perf_counter() - t)
    for r in reqs:
        s.abort_now(r, "benchmark done", 499)
    return 1000 * statistics.median(times)


def mask_ms(engine: Engine, batch: int, repeats: int = 30) -> float:
    """Median ms of GrammarMask.apply over `batch` rows, each matcher inside a JSON string (the common state)."""
    import torch

    from common.engine.grammar.mask import GrammarMask
    from common.engine.grammar.req_grammar import ReqGrammar

    spec = GrammarSpec("json_schema", canonical_json(LONG, "schema"), "schema")
    fut = engine.grammar.compiled(spec)
    fut.result()
    ids = engine.tokenizer.encode('{"notes": ["Paris is')
    grammars = [ReqGrammar(spec, fut, None, engine.tokenizer.decode, engine.grammar.vocab_size) for _ in range(batch)]
    for g in grammars:
        for i, t in enumerate(ids):
            g.accept(t, ids[:i])
    mask = GrammarMask(grammars, [list(ids)] * batch, "cpu")
    logits = torch.randn(batch, engine.grammar.vocab_size)
    times = []
    for _ in range(repeats):
        rows = logits.clone()
        t = time.perf_counter()
        mask.apply(rows)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def compile_ms(engine: Engine, repeats: int = 5) -> tuple[float, float]:
    """A tool schema compiled cold (a key not seen before) and then from the cache (median ms)."""
    cold, cached = [], []
    for i in range(repeats):
        schema = TOOL | {"description": f"variant {i} {time.time()}"}  # a fresh key
        spec = GrammarSpec("json_schema", canonical_json(schema, "schema"), "schema")
        t = time.perf_counter()
        engine.grammar.compiled(spec).result()
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.grammar.compiled(spec).result()
        cached.append(time.perf_counter() - t)
    return 1000 * statistics.median(cold), 1000 * statistics.median(cached)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mask-only", action="store_true", help="time the bitmask and compilation, not model steps")
    a = ap.parse_args()
    engine = Engine(ServerConfig(model="builtin", device=a.device, max_total_tokens=32768, max_running_requests=64))
    rows = []
    for b in a.batches if a.mask_only else ():
        print(json.dumps({"batch": b, "mask_ms": round(mask_ms(engine, b), 3)}), flush=True)
    for b in a.batches if not a.mask_only else ():
        plain, constrained = step_ms(engine, b, a.steps, False), step_ms(engine, b, a.steps, True)
        rows.append({"batch": b, "plain_ms": round(plain, 2), "constrained_ms": round(constrained, 2),
                     "overhead": f"{100 * (constrained / plain - 1):+.1f}%"})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    cold, cached = compile_ms(engine)
    print(json.dumps({"tool_schema_compile_cold_ms": round(cold, 2), "cached_ms": round(cached, 4)}))
    engine.stop()


if __name__ == "__main__":
    main()

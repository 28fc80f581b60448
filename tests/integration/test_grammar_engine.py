"""Constrained decoding inside one engine (the built-in model, no server): Hypothesis draws JSON schemas from
the subset the tests bound (every value has a bounded length and the engine allows one whitespace character
per run, so an answer ends within ANSWER_BOUND tokens whatever the model prefers), and every answer,
greedy and sampled, validates against its schema (jsonschema); a retracted request's matcher goes on
where it was, so its output equals an unretracted run's; a request aborted while its grammar compiles
leaves nothing behind.

Each example runs the model, so the example count is this test's own (not the profile's)."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import ServerConfig
from common.core.request import FinishReason, Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
from common.wire.structured_output import GrammarSpec, canonical_json
from tests.served_model import served_model_dir

NAMES = st.sampled_from(["name", "city", "count", "ok", "tags", "size", "kind"])
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 999}, st.integers(-1000, 1000)),
    st.just({"type": "boolean"}),
    st.builds(lambda vs: {"type": "string", "enum": vs}, st.lists(st.sampled_from(["a", "bb", "ccc"]), min_size=1, max_size=3, unique=True)),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": n}, st.integers(0, 3)),
)  # fmt: skip


def objects(values) -> st.SearchStrategy:
    return st.dictionaries(NAMES, values, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    )


SCHEMAS = objects(st.one_of(LEAVES, objects(LEAVES)))
# the longest answer: 3 keys of 3-leaf objects, each leaf an 8-character string of multi-token characters with a
# whitespace character at each place the grammar allows one (about 420 tokens); answers here take 30-110
ANSWER_BOUND = 512
DIGITS = {"type": "string", "pattern": "^[0-9]{1,3}$"}


@pytest.fixture(scope="module")
def engine():
    e = Engine(ServerConfig(model="builtin", max_total_tokens=4096, page_size=4, constrained_json_max_whitespace=1))
    yield e
    e.stop()


def test_a_start_builds_no_compiler_and_the_first_constrained_request_does(engine):
    e = Engine(ServerConfig(model=str(served_model_dir()), max_total_tokens=1024, page_size=4))
    try:
        assert e.grammar.compiler is None  # the vocabulary's token table is not built at start-up
        assert prompt(e) == prompt(engine)  # the cut model (common/model/truncate.py) kept the chat template
        req = Req("first", prompt(e), SamplingParams(max_new_tokens=8, temperature=0), grammar_spec=spec(DIGITS))
        run(e, [req])
        assert e.grammar.compiler is not None and e.grammar.info_dict()["compiles"] == 1
        assert (
            req.finish.type == "stop"
            and json.loads(e.tokenizer.decode(req.output_ids, skip_special_tokens=True)).isdigit()
        )
    finally:
        e.stop()


def run(engine: Engine, reqs: list[Req], between=None) -> None:
    for r in reqs:
        engine.scheduler.add_request(r)
    steps = 0
    while engine.scheduler.has_work():
        engine.scheduler.step()
        steps += 1
        if between is not None:
            between(steps)
    counts = engine.scheduler.check_integrity()
    assert counts.owned == counts.locked == 0


def prompt(engine: Engine) -> list[int]:
    msgs = [{"role": "user", "content": "Answer in JSON."}]
    ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", canonical_json(schema, "schema"), "schema")


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_every_answer_validates_against_its_schema(engine, schema):
    ids = prompt(engine)
    params = [
        SamplingParams(max_new_tokens=ANSWER_BOUND, temperature=0),
        SamplingParams(max_new_tokens=ANSWER_BOUND, temperature=1.0, seed=3),
    ]
    reqs = [Req(f"r{i}", ids, p, grammar_spec=spec(schema)) for i, p in enumerate(params)]
    run(engine, reqs)
    for r in reqs:
        assert r.finish.type == "stop", (schema, engine.tokenizer.decode(r.output_ids))
        jsonschema.validate(json.loads(engine.tokenizer.decode(r.output_ids, skip_special_tokens=True)), schema)


def test_a_retracted_request_continues_its_grammar(engine):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}, "required": ["tags"]}  # fmt: skip
    params = SamplingParams(max_new_tokens=60, temperature=0)
    want = Req("alone", prompt(engine), params, grammar_spec=spec(schema))
    run(engine, [want])
    req = Req("retracted", prompt(engine), params, grammar_spec=spec(schema))

    def retract_once(step: int) -> None:
        if step == 6 and req in engine.scheduler.decode.running:
            engine.scheduler.retract(req)

    run(engine, [req], retract_once)
    assert engine.scheduler.decode.num_retractions >= 1
    assert req.output_ids == want.output_ids and req.finish.type == "stop"


def test_abort_while_the_grammar_compiles_frees_everything(engine):
    gate = threading.Event()
    engine.grammar._pool.submit(gate.wait)  # the compile thread is busy: the next compilation waits
    schema = {"type": "object", "properties": {"slow": {"type": "string", "pattern": "^[a-z]{1,30}$"}}}
    req = Req("aborted", prompt(engine), SamplingParams(max_new_tokens=8), grammar_spec=spec(schema))
    engine.scheduler.add_request(req)
    assert engine.scheduler.step() is False  # nothing to run: the request waits in its own queue
    assert engine.scheduler.grammars.waiting == [req] and req.req_pool_idx is None
    engine.scheduler.abort_now(req, "aborted by client", 499)
    assert req.finish == FinishReason("abort", message="aborted by client", status=499)
    gate.set()
    run(engine, [])
    assert not engine.scheduler.grammars.waiting and req.req_pool_idx is None

"""A request moved to another server mid-stream goes on exactly (common/wire/migration.py): split at any
position, the continuation (the prompt plus the tokens shown, replayed) draws the tokens and shows the text the
whole request would have. On a real engine with the tiny model: seeded sampling with penalties, a minimum of
new tokens and a stop string that must not match across the split; greedy; and n > 1 choices."""

from __future__ import annotations

import json

import pytest

from common.config import ServerConfig
from common.core.request import GenInput, OutputEvent, Req
from common.engine.engine import Engine
from common.http.serving import make_reqs
from common.wire.migration import Migration, ResumedChoice
from common.wire.sampling_params import SamplingParams
from tests.integration.tiny_model import random_prompts

SEEDED = dict(temperature=0.9, top_k=40, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(ServerConfig(model=str(tiny_model_dir), max_total_tokens=8192))


def run(engine: Engine, gen: GenInput) -> dict[int, list[OutputEvent]]:
    """Every event of every choice `gen` still has to generate, by choice index."""
    events: dict[int, list[OutputEvent]] = {}
    for i, req in make_reqs(gen):
        req.sink = events.setdefault(i, []).append
        engine.scheduler.add_request(req)
    while engine.scheduler.has_work():  # a grammar compiles off the scheduler thread
        engine.scheduler.step()
    return events


def shown(events: list[OutputEvent], k: int) -> tuple[list[int], str]:
    """The tokens and text of a choice's first k token events."""
    firsts = [ev for ev in events if ev.token_ids][:k]
    return [t for ev in firsts for t in ev.token_ids], "".join(ev.text for ev in firsts)


def tokens_and_text(events: list[OutputEvent]) -> tuple[list[int], str]:
    return [t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events)


def migration(resume: list[ResumedChoice | None] | None) -> Migration:
    return Migration(rid="r", created=1, seed=1234, resume=resume)


@pytest.mark.parametrize("kind", ["seeded", "router_seeded", "greedy"])
def test_a_request_split_at_any_position_gives_the_same_tokens_and_text(engine, kind):
    sampling = {"seeded": SEEDED | {"seed": 7}, "router_seeded": SEEDED, "greedy": {"temperature": 0}}[kind]
    params = SamplingParams(max_new_tokens=24, min_new_tokens=6, ignore_eos=True, stop=["qx"], **sampling)
    prompt = random_prompts(1, 20, 30, seed=5)[0]
    whole = run(engine, GenInput("r", prompt, params, migration=migration(None)))[0]
    ids, text = tokens_and_text(whole)
    assert len(ids) == 24 and whole[-1].finish.type == "length"
    for k in range(1, 24):
        out_ids, out_text = shown(whole, k)
        resumed = GenInput("r", prompt, params, migration=migration([ResumedChoice(output_ids=out_ids)]))
        rest = run(engine, resumed)[0]
        rest_ids, rest_text = tokens_and_text(rest)
        assert out_ids + rest_ids == ids, k
        assert out_text + rest_text == text, k
        assert rest[-1].meta["completion_tokens"] == 24 and rest[-1].meta["prompt_tokens"] == len(prompt)
    engine.scheduler.check_integrity()


def test_n_choices_go_on_where_each_was_left_and_ended_ones_stay_ended(engine):
    params = SamplingParams(max_new_tokens=12, n=3, ignore_eos=True, **SEEDED)
    prompt = random_prompts(1, 20, 30, seed=6)[0]
    whole = run(engine, GenInput("r", prompt, params, migration=migration(None)))
    ids = {i: tokens_and_text(evs)[0] for i, evs in whole.items()}
    assert len({tuple(v) for v in ids.values()}) == 3  # each choice its own stream
    resume = [
        ResumedChoice(output_ids=ids[0], finished=True),
        None,  # its client saw nothing of it: it starts over
        ResumedChoice(output_ids=ids[2][:5]),
    ]
    rest = run(engine, GenInput("r", prompt, params, migration=migration(resume)))
    assert set(rest) == {1, 2}
    assert tokens_and_text(rest[1])[0] == ids[1]
    assert ids[2][:5] + tokens_and_text(rest[2])[0] == ids[2]


def test_a_request_without_a_seed_draws_from_the_routers(engine):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, **SEEDED)
    prompt = random_prompts(1, 20, 30, seed=7)[0]
    first, second = (run(engine, GenInput("r", prompt, params, migration=migration(None)))[0] for _ in range(2))
    assert tokens_and_text(first) == tokens_and_text(second)
    # without the router's, each request draws a seed of its own
    alone = [tokens_and_text(run(engine, GenInput("r", prompt, params))[0])[0] for _ in range(3)]
    assert len({tuple(a) for a in alone}) > 1


def test_a_resumed_request_is_no_longer_than_it_would_have_been(engine):
    """The shown tokens count: max_new_tokens is the whole choice's."""
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0)
    prompt = random_prompts(1, 20, 30, seed=8)[0]
    req: Req = make_reqs(GenInput("r", prompt, params, migration=migration([ResumedChoice(output_ids=[3, 4])])))[0][1]
    assert (req.resumed_len, req.generated_ids, req.prompt_ids[-2:]) == (2, [3, 4], [3, 4])
    rest = run(engine, GenInput("r", prompt, params, migration=migration([ResumedChoice(output_ids=[3, 4])])))[0]
    assert len(tokens_and_text(rest)[0]) == 3


@pytest.fixture(scope="module")
def builtin_engine() -> Engine:
    e = Engine(ServerConfig(model="builtin", max_total_tokens=4096, page_size=4))
    yield e
    e.stop()


def test_a_constrained_request_split_goes_on_in_its_grammar(builtin_engine):
    """The resumed choice's matcher is fed the shown tokens: the rest is what the whole request drew, and the
    answer still validates."""
    from common.wire.structured_output import GrammarSpec, canonical_json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["city", "count"], "additionalProperties": False}  # fmt: skip
    grammar = GrammarSpec("json_schema", canonical_json(schema, "schema"), "schema")
    e = builtin_engine
    msgs = [{"role": "user", "content": "A city and a number, in JSON."}]
    ids = e.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(max_new_tokens=60, temperature=1.0, seed=9)
    whole = run(e, GenInput("g", prompt, params, migration=migration(None), grammar_spec=grammar))[0]
    out, text = tokens_and_text(whole)
    assert whole[-1].finish.type == "stop" and json.loads(text).keys() == {"city", "count"}
    for k in (1, len(out) // 2, len(out) - 1):
        resume = [ResumedChoice(output_ids=shown(whole, k)[0])]
        rest = run(e, GenInput("g", prompt, params, migration=migration(resume), grammar_spec=grammar))[0]
        assert out[:k] + tokens_and_text(rest)[0] == out, k

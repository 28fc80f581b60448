"""What a request asks its output to match: one GrammarSpec, from whichever field the client used.

The fields (OpenAI's, vLLM's and SGLang's names):

| field | kind |
| --- | --- |
| `response_format` `{"type": "json_object"}` / `{"type": "json_schema", "json_schema": {"schema", "strict"}}` | json_object / json_schema |
| `response_format` `{"type": "structural_tag", ...}` (SGLang) | structural_tag |
| `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM) | json_schema, regex, choice, ebnf |
| `structured_outputs` `{"json" / "regex" / "choice" / "grammar" / "json_object" / "structural_tag"}` (vLLM) | the same |
| `json_schema`, `regex`, `ebnf`, `structural_tag` (SGLang: `/generate`'s sampling_params, and the OpenAI bodies) | the same |

At most one may be given (a second is a 400 naming it). Torch-free and backend-free: whether the grammar
compiles is the engine's question (common/engine/grammar/backend.py), asked before anything is scheduled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from common.wire.errors import InvalidRequest

Kind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag", "choice"]
MAX_CHOICES = 256


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar: its kind, its text (a schema as canonical JSON, a regex, EBNF, a structural tag as JSON,
    choices as a JSON list), the request field it came from (errors name it), and whether it applies only
    once the model's thinking has ended (chat with --reasoning-parser). A JSON schema always compiles in
    xgrammar's strict mode, `strict` or not, as vLLM and SGLang compile it: an object that does not say
    `additionalProperties` has only the properties it names (else a model may append invented keys until its
    token limit); a schema that wants others says `additionalProperties: true`."""

    kind: Kind
    value: str
    param: str
    after_reasoning: bool = False

    @property
    def key(self) -> str:
        """What the compiled grammar is cached by (the same grammar from another field shares it)."""
        return f"{self.kind}:{self.value}"

    def gated(self, after_reasoning: bool) -> GrammarSpec:
        return replace(self, after_reasoning=after_reasoning)


def canonical_json(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as compact JSON (its cache key). Keys keep their
    order: the output's properties come in the schema's order."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{param}: not valid JSON: {e}", param=param) from None
    if isinstance(value, bool):  # true / false are JSON schemas too, but say nothing useful here
        raise InvalidRequest(f"{param}: give a JSON schema object", param=param)
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param}: a JSON schema must be an object, got {type(value).__name__}", param=param)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param}: give a non-empty string", param=param)
    return value


def _choices(value: Any, param: str) -> str:
    ok = isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
    if not ok or len(value) > MAX_CHOICES:
        raise InvalidRequest(f"{param}: give a list of 1 to {MAX_CHOICES} non-empty strings", param=param)
    return json.dumps(value, ensure_ascii=False)


def _structural_tag_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{param}: not valid JSON: {e}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param}: a structural tag is a JSON object", param=param)
    return json.dumps(value, ensure_ascii=False)


def from_response_format(value: Any) -> GrammarSpec | None:
    """OpenAI's response_format (SGLang's structural_tag type too); None for {"type": "text"}."""
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest(f"{param}: give an object with a type", param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidRequest(f"{param}.json_schema: give an object with a schema", param=f"{param}.json_schema")
        schema = inner.get("schema", inner.get("schema_", {"type": "object"}))
        strict = inner.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(f"{param}.json_schema.strict: give a boolean", param=f"{param}.json_schema.strict")
        where = f"{param}.json_schema.schema"
        return GrammarSpec("json_schema", canonical_json(schema, where), where)
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", _structural_tag_text(value, param), param)
    raise InvalidRequest(
        f"{param}.type: {kind!r} is not one of text, json_object, json_schema, structural_tag", param=f"{param}.type"
    )


def _from_structured_outputs(value: Any) -> GrammarSpec | None:
    """vLLM's structured_outputs object: exactly one of its fields."""
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param}: give an object", param=param)
    set_ = {k: v for k, v in value.items() if v not in (None, False) and k not in ("disable_any_whitespace",)}
    if len(set_) != 1:
        raise InvalidRequest(
            f"{param}: give exactly one of json, regex, choice, grammar, json_object, structural_tag", param=param
        )
    (name, v), where = next(iter(set_.items())), f"{param}.{next(iter(set_))}"
    if name == "json":
        return GrammarSpec("json_schema", canonical_json(v, where), where)
    if name == "json_object":
        return GrammarSpec("json_object", "", where)
    if name in FIELD_KINDS and name != "json_schema":
        kind, read = FIELD_KINDS[name]
        return GrammarSpec(kind, read(v, where), where)
    raise InvalidRequest(f"{where} is not supported by this server", param=where)


FIELD_KINDS: dict[str, tuple[Kind, Any]] = {
    "guided_json": ("json_schema", canonical_json),
    "guided_regex": ("regex", _text),
    "guided_choice": ("choice", _choices),
    "guided_grammar": ("ebnf", _text),
    "json_schema": ("json_schema", canonical_json),
    "regex": ("regex", _text),
    "ebnf": ("ebnf", _text),
    "grammar": ("ebnf", _text),
    "choice": ("choice", _choices),
    "structural_tag": ("structural_tag", _structural_tag_text),
}
BODY_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema", "regex", "ebnf")
GENERATE_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def from_body(data: dict[str, Any], prefix: str = "", fields: tuple[str, ...] = BODY_FIELDS) -> GrammarSpec | None:
    """The one constraint a request body (or /generate's sampling_params, `prefix` "sampling_params.") sets."""
    found: list[tuple[str, GrammarSpec]] = []  # (the field, its spec)
    if "response_format" in data and data["response_format"] is not None:
        spec = from_response_format(data["response_format"])
        found += [("response_format", spec)] if spec else []
    for name in fields:
        if data.get(name) is not None and data.get(name) != []:
            kind, read = FIELD_KINDS[name]
            found.append((prefix + name, GrammarSpec(kind, read(data[name], prefix + name), prefix + name)))
    spec = _from_structured_outputs(data.get("structured_outputs"))
    found += [("structured_outputs", spec)] if spec else []
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise InvalidRequest(f"{second}: give only one constraint (this request also sets {first})", param=second)
    return found[0][1] if found else None

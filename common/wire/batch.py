"""Batched prompts: a list of prompts in one request (OpenAI's /v1/completions `prompt`: strings or token-id lists;
SGLang's /generate `text` or `input_ids`, with `sampling_params` and `rid` one for all or one per prompt) split
into one body per prompt. The server and the router serve each part as a request of its own, all at once (so they
batch), and merge the answers in order: choice `prompt_i * n + j`, as vLLM and OpenAI number them; usage summed.
"""

from __future__ import annotations

from typing import Any

from common.wire.errors import InvalidRequest

MAX_PROMPTS = 1024  # per request; each prompt is a request of its own for the queue limits
COMPLETIONS, GENERATE = "/v1/completions", "/generate"
PER_PROMPT = ("sampling_params", "rid")  # /generate fields a batch may give as a list, one per prompt


def split_batch(path: str, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One body per prompt of a batched request on `path`, or None for a request of one prompt."""
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            return [body | {"prompt": p} for p in _counted(prompt, "prompt")]
        return None
    if path == GENERATE:
        return _split_generate(body)
    return None


def _split_generate(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    text, ids = body.get("text"), body.get("input_ids")
    key = "text" if isinstance(text, list) else "input_ids" if _is_list_of_lists(ids) else None
    if key is None:
        for name in PER_PROMPT:
            if isinstance(body.get(name), list):
                raise InvalidRequest(f"{name}: a list needs a list of prompts (text or input_ids)", param=name)
        return None
    prompts = _counted(body[key], key)
    lists = {name: _per_prompt(body, name, len(prompts)) for name in PER_PROMPT if name in body}
    return [body | {key: p} | {name: values[i] for name, values in lists.items()} for i, p in enumerate(prompts)]


def _per_prompt(body: dict[str, Any], name: str, n: int) -> list[Any]:
    """`name`'s value for each of the `n` prompts: its list, or its one value for all (sampling_params)."""
    value = body[name]
    if not isinstance(value, list):
        if name == "rid" and value is not None:
            raise InvalidRequest(f"rid: a batch of {n} prompts takes a list of {n} rids", param="rid")
        return [value] * n
    if len(value) != n:
        raise InvalidRequest(f"{name}: {len(value)} values for {n} prompts", param=name)
    return value


def _counted(prompts: list[Any], key: str) -> list[Any]:
    if not prompts:
        raise InvalidRequest(f"{key}: an empty list of prompts; give at least one", param=key)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"{key}: {len(prompts)} prompts; at most {MAX_PROMPTS} in one request", param=key)
    return prompts


def _is_list_of_lists(v: Any) -> bool:
    return isinstance(v, list) and any(isinstance(t, list) for t in v)


def part_error(message: str, param: str | None, index: int, listed: tuple[str, ...]) -> tuple[str, str | None]:
    """A part's error as the client's: the error of prompt `index` names the client's field (`prompt.1`,
    `sampling_params.1.temperature` where the client gave a list: the fields `listed`), or says the prompt."""
    head, dot, rest = (param or "").partition(".")
    if head not in listed:
        return f"prompt {index}: {message}", param
    renamed = f"{head}.{index}{dot}{rest}"
    if param and message.startswith(param):
        return renamed + message[len(param) :], renamed
    return f"{renamed}: {message}", renamed


def listed_fields(path: str, body: dict[str, Any]) -> tuple[str, ...]:
    """The fields of a batched `body` the client gave one value per prompt of (what part_error renames)."""
    if path == COMPLETIONS:
        return ("prompt",)
    key = "text" if isinstance(body.get("text"), list) else "input_ids"
    return (key, *(name for name in PER_PROMPT if isinstance(body.get(name), list)))


def summed_usage(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a batch: its prompts' usages added up, field by field."""
    total: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                total[key] = summed_usage([total.get(key, {}), value])
            else:
                total[key] = total.get(key, 0) + value
    return total


def stream_refused(path: str) -> InvalidRequest:
    """The router's answer to a batched request that streams (a server streams it: one event stream)."""
    return InvalidRequest(
        f"stream: a list of prompts is not streamed through the router; send stream false, or one prompt per "
        f"request (a server streams it on {path})",
        param="stream",
    )

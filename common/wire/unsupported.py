"""Request fields that would change the output and that Tandem does not implement.

OpenAI's, vLLM's and SGLang's request bodies carry many fields; unknown ones are ignored (clients send
plenty that change nothing: user, metadata, store, service_tier...). A field in these tables would make
the answer differ from what the client asked for, so a request that sets one to anything but its no-op
value is a 400 naming it, as vLLM rejects what it cannot do. Each entry: field -> the values that mean
"not used" (absent is always fine).
"""

from __future__ import annotations

from typing import Any

from common.wire.errors import InvalidRequest

# vLLM / SGLang extensions of both OpenAI endpoints (their constrained decoding fields are supported:
# common/wire/structured_output.py)
_CONSTRAINED = {
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "lora_path": (None,),
    "return_tokens_as_token_ids": (None, False),
}

COMPLETION = _CONSTRAINED | {"suffix": (None, "")}  # and best_of: reject_best_of

CHAT = _CONSTRAINED | {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "verbosity": (None, "medium"),
    # the prompt: Tandem applies the model's own chat template, with the generation prompt
    "chat_template": (None,),
    "documents": (None, []),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "echo": (None, False),
}

GENERATE = {
    "image_data": (None, []),
    "audio_data": (None, []),
    "video_data": (None, []),
    "input_embeds": (None,),
    "custom_logit_processor": (None,),
    "return_hidden_states": (None, False),
    "token_ids_logprob": (None,),
    "session_params": (None,),
    "return_text_in_logprobs": (None, False),
}

GENERATE_SAMPLING = {"custom_params": (None,)}


def reject_unsupported(data: Any, table: dict[str, tuple], prefix: str = "") -> None:
    """InvalidRequest naming the first field of `table` that `data` sets to a value it does not allow."""
    if not isinstance(data, dict):
        return
    for name, allowed in table.items():
        if name in data and not any(_same(data[name], a) for a in allowed):
            raise InvalidRequest(
                f"{prefix}{name} is not supported by this server (got {_short(data[name])})", param=prefix + name
            )


def reject_best_of(data: Any) -> None:
    """best_of is supported where it changes nothing: absent, or equal to n (each of the n is returned)."""
    if not isinstance(data, dict):
        return
    best_of = data.get("best_of")
    if best_of is not None and not (type(best_of) is int and best_of == data.get("n", 1)):
        raise InvalidRequest(
            f"best_of is not supported by this server unless it equals n (got {_short(best_of)})", param="best_of"
        )


def _same(value: Any, allowed: Any) -> bool:
    """Equal, and of the same JSON type (False is not 0, "none" is not None)."""
    return type(value) is type(allowed) and value == allowed


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

"""What a server says about itself and its tokenizer: /version (vLLM's and SGLang's), /get_model_info (SGLang's),
/tokenize and /detokenize (common/wire/tokenize.py: vLLM's shapes and SGLang's)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from common.edge.asgi import read_body
from common.engine.engine import Engine
from common.http.serving import check_token_ids
from common.wire.api import parse_body
from common.wire.errors import InvalidRequest
from common.wire.tokenize import DetokenizeRequest, TokenizeRequest
from common.wire.version import package_version


def add_info_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/version")
    async def server_version() -> dict[str, Any]:
        return {"version": package_version()}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return model_info_of(engine)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(await read_body(request, engine.config.max_request_bytes), TokenizeRequest)
        return tokenized(engine, body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(await read_body(request, engine.config.max_request_bytes), DetokenizeRequest)
        return detokenized(engine, body)


def model_info_of(engine: Engine) -> dict[str, Any]:
    """SGLang's /get_model_info fields, and the model's name and context length."""
    path = str(engine.parts.model.model_dir)
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": engine.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(engine.hf_config, "model_type", None),
        "architectures": getattr(engine.hf_config, "architectures", None),
        "max_model_len": engine.context_len,
    }


def tokenized(engine: Engine, body: TokenizeRequest) -> dict[str, Any]:
    """{tokens, count, max_model_len} (each a list for SGLang's list of prompts), and vLLM's token_strs if asked."""
    tok = engine.tokenizer
    if body.messages is not None:
        ids: Any = _chat_ids(tok, body)
        count: Any = len(ids)
    else:
        special = body.add_special_tokens is not False
        prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        lists = [tok.encode(p, add_special_tokens=special) for p in prompts]
        ids, count = (lists, [len(x) for x in lists]) if isinstance(body.prompt, list) else (lists[0], len(lists[0]))
    out = {"tokens": ids, "count": count, "max_model_len": engine.context_len}
    if body.return_token_strs:
        strs = tok.convert_ids_to_tokens
        out["token_strs"] = [strs(x) for x in ids] if isinstance(body.prompt, list) else strs(ids)
    return out


def _chat_ids(tok: Any, body: TokenizeRequest) -> list[int]:
    messages = [m.for_template() for m in body.messages or ()]
    try:
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=False,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja errors from the model's own template
        raise InvalidRequest(f"messages: the chat template rejected them: {e}", param="messages") from None
    return tok.encode(text, add_special_tokens=bool(body.add_special_tokens))


def detokenized(engine: Engine, body: DetokenizeRequest) -> dict[str, Any]:
    """The text of the ids, as vLLM's `prompt` and SGLang's `text` (a list of texts for a list of id lists)."""
    lists = body.tokens if body.tokens and isinstance(body.tokens[0], list) else [body.tokens]
    vocab = engine.hf_config.vocab_size
    for i, ids in enumerate(lists):
        check_token_ids(ids, vocab, f"tokens.{i}" if lists is body.tokens else "tokens")
    texts = [engine.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]
    text: Any = texts if lists is body.tokens else texts[0]
    return {"prompt": text, "text": text}

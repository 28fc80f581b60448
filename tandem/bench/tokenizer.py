"""The tokenizer that turns bench prompts into token ids: the `tokenizers` library on a model's
tokenizer.json, so `tandem bench` stays torch-free (a GGUF never served before is converted once,
which does import torch)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from common.model.locate import BUILTIN_NAMES, existing_model_dir
from common.wire.user_error import UserError


def load_tokenizer(spec: str) -> Tokenizer:
    """`spec`: 'builtin', a directory with tokenizer.json, a .gguf file, or a Hugging Face Hub name."""
    local = Path(spec).expanduser()
    if (local / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(local / "tokenizer.json"))
    if spec not in BUILTIN_NAMES and not local.exists():
        return _from_hub(spec)
    try:
        model_dir = existing_model_dir(spec)
        if model_dir is None:  # a GGUF no server has converted yet
            from common.model.loader import resolve_model_dir

            model_dir = resolve_model_dir(spec)
    except UserError as e:  # it names --model: the tokenizer's flag is another
        raise SystemExit(f"--tokenizer {spec}: {str(e).removeprefix(f'--model {spec}: ')}") from None
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise SystemExit(
            f"--tokenizer {spec}: {model_dir} has no tokenizer.json; give a model directory with a fast tokenizer"
        )
    return Tokenizer.from_file(str(path))


def _from_hub(spec: str) -> Tokenizer:
    try:
        return Tokenizer.from_pretrained(spec)
    except Exception as e:  # the Hub client raises many kinds: offline, 404, gated
        raise SystemExit(
            f"--tokenizer {spec}: not 'builtin', a local directory or .gguf file, and the Hugging Face Hub "
            f"did not give it ({e}); pass the path of the served model's tokenizer"
        ) from None


def ordinary_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Every id but the special tokens (BOS, EOS, chat markers): what random prompts are drawn from."""
    special = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size()) if i not in special]

"""The model a test server runs when its test names none (`--model`): the built-in model cut to its first
LAYERS layers (SmolLM2-135M, 4 of its 30) by common/model/truncate.py, with its tokenizer, chat template and
tied embeddings. Its tokens come from real embeddings and read as text, not as the full model's answers; a
decode step costs about a third of the full model's on the CPU, and the suite is mostly decode steps. It is
served under the built-in model's name, the one the tests' clients send. Tests that need the full model's
answers ("Paris", a JSON answer that ends, a stop string met), or compare with transformers on the built-in
weights, pass `--model builtin`."""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

LAYERS = 4


def served_model_flags() -> list[str]:
    """The `tandem serve` flags that run the cut model under the built-in model's name."""
    from common.model.locate import BUILTIN_NAME

    return ["--model", str(served_model_dir()), "--served-model-name", BUILTIN_NAME]


@cache
def served_model_dir() -> Path:
    """The cut model's directory, next to the built-in model's in the cache: written once, under a temporary
    name renamed into place, so that another pytest process never reads half of it."""
    from common.model.loader import resolve_model_dir
    from common.model.truncate import truncate_model

    full = resolve_model_dir("builtin")
    cut = full.parent / f"{full.name}-first{LAYERS}"
    if not cut.exists():
        part = Path(tempfile.mkdtemp(prefix=f".{cut.name}-", dir=cut.parent))
        truncate_model(str(full), LAYERS, part)
        try:
            os.rename(part, cut)
        except OSError:  # another process wrote it first
            shutil.rmtree(part, ignore_errors=True)
    return cut

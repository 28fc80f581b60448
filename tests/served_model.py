"""The model a test server runs when its test names none (`--model`): the built-in model cut to its first
LAYERS layers (SmolLM2-135M, 4 of its 30), with its tokenizer, chat template and tied embeddings. Its
tokens come from real embeddings and read as text, not as the full model's answers; a decode step costs
about a third of the full model's on the CPU, and the suite is mostly decode steps. It is served under the
built-in model's name, the one the tests' clients send. Tests that need the full model's answers ("Paris",
a JSON answer that ends, a stop string met), or compare with transformers on the built-in weights, pass
`--model builtin`."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

LAYERS = 4
WEIGHTS = "model.safetensors"


def served_model_flags() -> list[str]:
    """The `tandem serve` flags that run the cut model under the built-in model's name."""
    from common.model.locate import BUILTIN_NAME

    return ["--model", str(served_model_dir()), "--served-model-name", BUILTIN_NAME]


@cache
def served_model_dir() -> Path:
    """The cut model's directory, next to the built-in model's in the cache (written once, atomically)."""
    from common.model.loader import resolve_model_dir

    full = resolve_model_dir("builtin")
    cut = full.parent / f"{full.name}-first{LAYERS}"
    if not (cut / ".complete").exists():
        write_first_layers(full, cut, LAYERS)
    return cut


def write_first_layers(full: Path, cut: Path, layers: int) -> None:
    """`full` with only decoder layers 0..layers-1 (its other files copied), renamed into place as `cut`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    part = Path(tempfile.mkdtemp(prefix=f".{cut.name}-", dir=cut.parent))
    for f in full.iterdir():
        if f.is_file() and f.name not in (WEIGHTS, "config.json"):
            shutil.copy(f, part / f.name)
    config = json.loads((full / "config.json").read_text())
    (part / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}, indent=2))
    with safe_open(full / WEIGHTS, "pt") as weights:
        kept = {k: weights.get_tensor(k) for k in weights.keys() if _layer(k) < layers}
    save_file(kept, part / WEIGHTS, metadata={"format": "pt"})
    (part / ".complete").touch()
    try:
        os.rename(part, cut)
    except OSError:  # another process wrote it first
        shutil.rmtree(part, ignore_errors=True)


def _layer(name: str) -> int:
    """The decoder layer a weight belongs to (-1 for the embeddings, the final norm and the head)."""
    return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else -1

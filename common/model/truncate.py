"""A draft model for STANDALONE speculative decoding cut from the target itself: its first N decoder layers,
its embedding, final norm and LM head, and its tokenizer (the same vocabulary by construction).

    python -m common.model.truncate --model builtin --layers 6 --out /tmp/smollm2-draft6
    tandem serve --model builtin --speculative-algorithm STANDALONE --speculative-draft-model-path /tmp/smollm2-draft6
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from common.model.loader import resolve_model_dir

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
TOKENIZER_FILES = (  # the chat template too: transformers may keep it in a file of its own
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def truncate_model(model: str, layers: int, out: Path) -> Path:
    """Write the first `layers` decoder layers of `model` (a name or directory the server takes) to `out`."""
    src = resolve_model_dir(model)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers {layers}: the model has {config['num_hidden_layers']}")
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                m = LAYER.match(name)
                if m is None or int(m.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the target: builtin, a GGUF file or a HF directory")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep (the first ones)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    args = parser.parse_args()
    print(truncate_model(args.model, args.layers, args.out))


if __name__ == "__main__":
    main()

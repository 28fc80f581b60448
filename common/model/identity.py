"""A model's identity for pairing: a hash of its config.json (keys sorted) and of its weights' names,
shapes and dtypes, read from the safetensors headers (no weight is read). Two servers of the same
checkpoint agree wherever its copies live; a different model or a different revision does not."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from common.model.weights import read_header


def model_identity(model_dir: Path) -> str:
    digest = hashlib.sha256(json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True).encode())
    for shard in sorted(model_dir.glob("*.safetensors")):
        header, _ = read_header(shard)
        for name in sorted(header):
            digest.update(f"{name}:{header[name]['dtype']}:{header[name]['shape']}\n".encode())
    return digest.hexdigest()[:16]

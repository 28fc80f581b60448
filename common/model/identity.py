"""A model's identity for pairing: a hash of its config.json (keys sorted) and of its weights' names,
shapes and dtypes, read from the safetensors headers (no weight is read). Two servers of the same
checkpoint agree wherever its copies live; a different model or a different revision does not. The KV store
also names pages by `weights_fingerprint` (sampled weight values)."""

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


SAMPLE_BYTES = 1 << 16


def weights_fingerprint(model_dir: Path) -> str:
    """A digest of the weights' values, sampled (64 KiB at the start, middle and end of each shard's data):
    a fine-tune of the same architecture, which model_identity cannot tell apart, gets another one. Cheap
    enough for start-up: a few reads per shard, whatever the model's size."""
    digest = hashlib.sha256()
    for shard in sorted(model_dir.glob("*.safetensors")):
        _, start = read_header(shard)
        size = shard.stat().st_size
        with open(shard, "rb") as fh:
            for at in (start, (start + size) // 2, size - SAMPLE_BYTES):
                fh.seek(max(start, at))
                digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]

"""Which GPU each engine process of `tandem up` gets.

One GPU per engine process while there are enough (CUDA_VISIBLE_DEVICES per child). With fewer GPUs the
processes share them round-robin; processes sharing a GPU start one after another, and the k-th of n gets
k/n of --mem-fraction-static: each sizes its KV pool from what the earlier ones left, so together they
use the fraction one process alone would.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from typing import Protocol

from common.config import ServerConfig

FRACTION_FLAG = "--mem-fraction-static"


class EngineChild(Protocol):
    name: str
    argv: list[str]
    env: dict[str, str]
    after: str | None


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return (
        [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]
        if out.returncode == 0
        else []
    )


def base_fraction(extra: list[str]) -> float:
    """--mem-fraction-static as every server would read it: from the flags passed to all of them (either
    spelling), else TANDEM_MEM_FRACTION_STATIC, else its default."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(FRACTION_FLAG, type=float, default=os.environ.get("TANDEM_MEM_FRACTION_STATIC"))
    value = parser.parse_known_args(extra)[0].mem_fraction_static
    return float(value) if value is not None else ServerConfig.model_fields["mem_fraction_static"].default


def plan_gpus(engines: list[EngineChild], gpus: list[str], fraction: float) -> list[str]:
    """Set each engine child's CUDA_VISIBLE_DEVICES (and, when it shares its GPU, its fraction and the
    child it starts after); returns one line per child saying what it got."""
    if not gpus:
        raise ValueError(
            "--device cuda but no GPU is visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is empty): "
            "use --device cpu, or make a GPU visible"
        )
    groups: dict[str, list[EngineChild]] = {}
    for i, child in enumerate(engines):
        gpu = gpus[i % len(gpus)]
        child.env["CUDA_VISIBLE_DEVICES"] = gpu
        groups.setdefault(gpu, []).append(child)
    lines = []
    for gpu, group in groups.items():
        for k, child in enumerate(group, 1):
            if len(group) == 1:
                lines.append(f"{child.name} -> GPU {gpu}")
                continue
            share = fraction * k / len(group)
            child.argv += [FRACTION_FLAG, f"{share:.4f}"]
            child.after = group[k - 2].name if k > 1 else None
            lines.append(
                f"{child.name} -> GPU {gpu}, shared by {len(group)} processes "
                f"({FRACTION_FLAG} {share:.4f}{f', starts after {child.after}' if child.after else ''})"
            )
    return lines

"""`tandem up`'s LoRA flags: `tandem serve`'s own (--enable-lora, --lora-paths, --max-loras-per-batch,
--max-lora-rank, --lora-target-modules), given once and passed to every engine server (a PD request's adapter
must be on both halves); the router needs none (its /load_lora_adapter fans out to the servers)."""

from __future__ import annotations

import argparse

from common.lora.targets import TARGET_MODULES

VALUED = ("max_loras_per_batch", "max_lora_rank")


def add_up_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (every engine server: `tandem serve --help`)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    g.add_argument("--lora-paths", nargs="+", help="NAME=PATH, PATH or a JSON object per adapter (PEFT directories)")
    g.add_argument("--max-loras-per-batch", type=int, help="adapter slots per server")
    g.add_argument("--max-lora-rank", type=int, help="the largest rank a slot holds")
    g.add_argument("--lora-target-modules", nargs="+", choices=TARGET_MODULES, help="projections adapters may change")


def lora_flags(ns: argparse.Namespace) -> list[str]:
    """The `tandem serve` flags of the LoRA flags given to `tandem up`."""
    out = ["--enable-lora"] if ns.enable_lora else []
    out += ["--lora-paths", *ns.lora_paths] if ns.lora_paths else []
    for name in VALUED:
        if getattr(ns, name) is not None:
            out += ["--" + name.replace("_", "-"), str(getattr(ns, name))]
    out += ["--lora-target-modules", *ns.lora_target_modules] if ns.lora_target_modules else []
    return out

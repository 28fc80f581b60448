"""A decode step with LoRA adapters (--enable-lora): batches of 16, their requests under 0 (the base model
alone), 1, 4 or 8 different rank-8 adapters of all seven projections, each a median scheduler step on one
engine with 8 slots, the four measured in turn `--rounds` times (the least of each kept: the machine is
shared); the engine's start with the adapters; and one adapter's load into a slot, from disk (reading the
PEFT directory, then the copy) and from host memory (the copy alone: what an LRU miss costs), the median of
LOADS each. `--model tiny`: the tiny random Llama of the tests.

    .venv/bin/python benchmarks/lora_decode.py [--model builtin|tiny] [--steps 30] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.config import ServerConfig  # noqa: E402
from common.core.request import Req  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.lora.adapter import load_adapter  # noqa: E402
from common.lora.setup import module_shapes  # noqa: E402
from common.lora.targets import TARGET_MODULES  # noqa: E402
from common.model.loader import load_hf_config, resolve_model_dir  # noqa: E402
from common.wire.sampling_params import SamplingParams  # noqa: E402
from tests.integration.tiny_model import random_prompts, save_tiny_llama  # noqa: E402

BATCH, RANK, ADAPTERS, PROMPT_LEN, WARMUP, LOADS = 16, 8, 8, 32, 5, 10


def save_adapter(path: Path, hf, seed: int) -> str:
    """A PEFT-format adapter (what peft's save_pretrained writes), random A and B."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf.num_hidden_layers):
        for m, (out, inp) in module_shapes(hf).items():
            where = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, inp, generator=g) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.05
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGET_MODULES)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return f"a{seed}={path}"


def step_ms(engine: Engine, distinct: int, steps: int) -> float:
    """Median decode step of BATCH requests spread over `distinct` adapters (0: none)."""
    s, names = engine.scheduler, list(engine.lora.ids)[:distinct]
    params = SamplingParams(max_new_tokens=WARMUP + steps + 8, temperature=0, ignore_eos=True)
    reqs = []
    for i, p in enumerate(random_prompts(BATCH, PROMPT_LEN, PROMPT_LEN, seed=distinct)):
        name = names[i % distinct] if distinct else None
        reqs.append(Req(f"r{distinct}-{i}", p, params, lora=name, lora_id=engine.lora.ids.get(name, 0)))
        s.add_request(reqs[-1])
    while len(s.decode.running) < BATCH:
        s.step()
    for _ in range(WARMUP):
        s.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        s.step()
        times.append(time.perf_counter() - t0)
    assert len(s.decode.running) == BATCH, "a request finished during the measurement"
    while s.decode.running:
        s.step()
    return statistics.median(times) * 1e3


def load_ms(engine: Engine, path: str) -> tuple[float, float]:
    """Median ms of one adapter into slot 0: read from disk and copied, and copied from host memory alone."""
    slots, disk, host = engine.lora.slots, [], []
    for _ in range(LOADS):
        t0 = time.perf_counter()
        adapter = load_adapter("timed", path)
        slots.load(0, adapter)
        t1 = time.perf_counter()
        slots.load(0, adapter)
        host.append(time.perf_counter() - t1)
        disk.append(t1 - t0)
    return statistics.median(disk) * 1e3, statistics.median(host) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", choices=["builtin", "tiny"], default="builtin")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tandem-lora-") as tmp:
        model = str(save_tiny_llama(Path(tmp) / "tiny")) if args.model == "tiny" else "builtin"
        hf = load_hf_config(resolve_model_dir(model))
        paths = [save_adapter(Path(tmp) / f"a{i}", hf, i) for i in range(ADAPTERS)]
        t0 = time.perf_counter()
        config = ServerConfig(
            model=model, enable_lora=True, lora_paths=paths, max_loras_per_batch=ADAPTERS, max_total_tokens=16384
        )
        engine = Engine(config)
        built = time.perf_counter() - t0
        runs = [[step_ms(engine, k, args.steps) for k in (0, 1, 4, 8)] for _ in range(args.rounds)]
        rows = [(k, min(r[i] for r in runs)) for i, k in enumerate((0, 1, 4, 8))]
        disk_ms, host_ms = load_ms(engine, paths[0].split("=", 1)[1])  # last: it overwrites slot 0
    base = rows[0][1]
    print(f"{args.model} model, batch {BATCH}, rank {RANK} on all 7 projections, {torch.get_num_threads()} threads")
    print(
        f"engine start with {ADAPTERS} adapters: {built:.2f} s; adapters loaded into slots: {engine.lora.slots.loads}"
    )
    print(f"one adapter into a slot: from disk {disk_ms:.2f} ms, from host memory {host_ms:.2f} ms")
    print(f"{'adapters':>8} | {'step ms':>8} | {'vs base':>7}")
    for k, ms in rows:
        print(f"{k:>8} | {ms:>8.2f} | {ms / base:>7.2f}")


if __name__ == "__main__":
    main()

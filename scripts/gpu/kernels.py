"""FlashInfer's kernel modules the GPU check uses, built ahead of time with nvcc on a CPU machine (check.sh
prep-kernels), one xz-compressed .so per module under .gpu/kernels/: the GPU run puts each where FlashInfer looks
for ahead-of-time modules (flashinfer/data/aot/<name>/<name>.so), loads it, and JIT-builds only a module that is
missing or fails to load (FlashInfer does that fallback itself, with a warning).

    python scripts/gpu/kernels.py build DIR [MODULE...]   # build with FlashInfer's own entry points, pack DIR/<name>.so.xz
    python scripts/gpu/kernels.py names                   # the modules' short names (prefill128, ...)

The modules are what Tandem's FlashInferAttention plans (fa2, bf16 pages, int32 indptr) for the check's shapes:
a paged prefill module per head_dim, and for decode the same prefill module where a KV head serves 4 or more query
heads (tensor-core decode), else a decode module; and the sampler's. Each module is built by calling the function
FlashInfer's wrappers call (`get_batch_prefill_module`, ...), so its name and sources are FlashInfer's own; a
module loads here too (against a link-time libcuda stub) before it is packed.
"""

from __future__ import annotations

import lzma
import os
import sys
import time
from pathlib import Path

# (query heads, KV heads, head_dim) of the check's models and tests: the 8B shape and the attention test, the
# SmolLM2 shape (parity), the tiny model of tests/gpu/test_cuda_graphs.py
SHAPES = [(32, 8, 128), (8, 2, 128), (9, 3, 64), (4, 2, 64)]
TENSOR_CORE_GROUP = 4  # FlashInferAttention.use_tensor_cores: query heads per KV head


def module_builders() -> dict[str, object]:
    """short name -> a call that builds (or loads) one module through FlashInfer's own entry point."""
    import torch
    from flashinfer.decode import get_batch_decode_module
    from flashinfer.prefill import get_batch_prefill_module
    from flashinfer.sampling import get_sampling_module

    bf, i32 = torch.bfloat16, torch.int32
    out: dict[str, object] = {"sampling": get_sampling_module}
    for hq, hkv, d in SHAPES:  # posenc NONE, no sliding window, no soft cap, no fp16 QK reduction
        out[f"prefill{d}"] = lambda d=d: get_batch_prefill_module("fa2", bf, bf, bf, i32, d, d, 0, False, False, False)
        if hq // hkv < TENSOR_CORE_GROUP:
            out[f"decode{d}"] = lambda d=d: get_batch_decode_module(bf, bf, bf, i32, d, d, 0, False, False)
    return out


def built_modules() -> dict[str, Path]:
    """name -> .so of every module in FlashInfer's JIT cache (FLASHINFER_WORKSPACE_BASE)."""
    from flashinfer.jit import env

    return {p.parent.name: p for p in sorted(env.FLASHINFER_JIT_DIR.glob("*/*.so")) if p.stem == p.parent.name}


def build(out: Path, only: list[str]) -> None:
    builders = module_builders()
    unknown = set(only) - set(builders)
    if unknown:
        raise SystemExit(f"unknown module {sorted(unknown)}; choose from {sorted(builders)}")
    out.mkdir(parents=True, exist_ok=True)
    for short in only or builders:
        start = time.monotonic()
        builders[short]()  # builds with nvcc (MAX_JOBS units at once), then loads it
        print(f"built {short} in {time.monotonic() - start:.0f} s", flush=True)
        pack(out)  # after each: a build stopped later keeps the modules done


def pack(out: Path) -> None:
    """Every module built so far as out/<name>.so.xz (unless already packed from this build)."""
    for name, so in built_modules().items():
        packed = out / f"{name}.so.xz"
        if not packed.exists() or packed.stat().st_mtime < so.stat().st_mtime:
            packed.write_bytes(lzma.compress(so.read_bytes(), preset=6))
            print(f"{packed}: {so.stat().st_size / 2**20:.1f} MiB, packed {packed.stat().st_size / 2**20:.2f} MiB")


def main(argv: list[str]) -> None:
    if argv[:1] == ["build"] and len(argv) >= 2:
        build(Path(argv[1]), argv[2:])
    elif argv == ["names"]:
        print("\n".join(module_builders()))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    if not os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        raise SystemExit("set FLASHINFER_CUDA_ARCH_LIST (check.sh prep-kernels does: 9.0a, the H100/H200)")
    main(sys.argv[1:])

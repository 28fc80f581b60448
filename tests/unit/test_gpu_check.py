"""scripts/gpu/check.sh without a GPU (TANDEM_GPU_CHECK_FAKES): every step runs as a canned result, so its
control flow is checked (order, a failed step not stopping the next, the deadline skipping the rest, the
JIT verdict choosing the attention backend, the transfer ratios measured only after the kernels are built, a
correctness step added by one line) and its summary is built from fake results, after every step (a run cut
short keeps what passed); every file a step names exists in the checkout, and every module an Engine imports
is on the GPU machine's image or in the check's bundle, so the check keeps in step with the code."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu" / "check.sh"
ENV = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "torch": "2.11.0+cu130",
    "nvcc": "Cuda compilation tools, release 13.0, V13.0.88",
    "d2d_copy_45MiB_GBps": 1200.0,
    "d2d_copy_128MiB_GBps": 1300.0,
    "d2d_copy_1024MiB_GBps": 1400.0,
    "d2d_rw_GBps": 2800.0,
    "bf16_mm_TFLOPs": 700.0,
    "fp8_index": 8.0,
    "import flashinfer": "0.7.2.post1 3.1s",
    "import nixl._api": "FAIL ImportError('libcuda')",
}
BENCH = (
    "backend   case                   layout         MiB pieces ours GB/s raw GB/s ratio raw pieces GB/s ratio\n"
    "nixl      2k-prompt fragmented   page-major    45.0    128   1000.000 1100.000  0.91        1200.000  0.83\n"
    "nixl      256MiB pool            page-major   256.0      8   1250.000 1300.000  0.96        1300.000  0.96\n"
)
ROOFLINE = {
    "graphs_vs_eager": {"requests": 64, "equal": 63, "tokens": 3100, "first_diffs": [17]},
    "rows": [
        dict(backend="flashinfer", graphs=g, batch=b, step_ms=s, gpu_kernel_ms=s * 0.8, kernels=300, roofline_ms=2.0,
             step_over_roofline=round(s / 2.0, 2))
        for g, b, s in ((True, 1, 2.5), (True, 64, 2.9), (False, 1, 6.0))
    ]
}  # fmt: skip
PARITY = {"flashinfer": {"rows": [dict(lp_max=0.01, top1_agree=1.0, greedy_full=True, top2_gap=None)] * 2}}
PD = {"ttft_ms": {"mono": {"16": 9.0}, "pd": {"16": 12.5}}, "pd_added_ms": {"16": 3.5}, "pd_greedy_equals_mono": [True]}


def fakes(root: Path, jit_ok: bool = True, probe_seconds: int = 0) -> Path:
    """Canned results per step: FAKES/<step>/{log, rc, seconds, *.json} and FAKES/jit/*.log."""
    files = {
        "probe/env.json": json.dumps(ENV),
        "probe/log": "probe done\n",
        "transfer_tests/log": "3 passed in 41.0s\n",
        "bench_nixl/log": BENCH,
        "bench_mooncake/log": "RuntimeError: Mooncake batch write failed\n",
        "bench_mooncake/rc": "1",
        "gpu_tests/log": "1 failed, 14 passed in 120.0s\n",
        "deterministic_tests/log": "deterministic: batch 8 == alone (graphs): held\n"
        "deterministic: chunked prefill (64) == one chunk: DIFFERS\n1 failed, 5 passed in 40.0s\n",
        "parity/parity.json": json.dumps(PARITY),
        "parity/log": "01:02:03 INFO common.engine.graph_capture: CUDA graphs: 9 sizes of decode steps captured in 2.1 s, "
        "310 MiB (402 MiB set aside before the KV pool)\n",
        "roofline/roofline.json": json.dumps(ROOFLINE),
        "pd_ttft/pd_ttft.json": json.dumps(PD),
    }
    for name in ("128-EXTEND", "64-EXTEND", "64-DECODE", "sampling-k"):
        files[f"jit/{name}.log"] = f"JIT OK {name} 80.0s\n" if jit_ok or name != "sampling-k" else "nvcc failed\n"
    files["jit/64-DECODE.log"] = (
        "WARNING flashinfer.jit: Failed to load AOT artifact x.so: libcuda.so.1. Trying another provider or falling "
        "back to JIT build.\nINFO flashinfer.jit: Building JIT module batch_decode_hd64; this can take minutes\n"
    ) + files["jit/64-DECODE.log"]
    if probe_seconds:
        files["probe/seconds"] = str(probe_seconds)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def check_env(tmp_path: Path, deadline: int = 540, **kw) -> dict[str, str]:
    return os.environ | {
        "TANDEM_GPU_CHECK_FAKES": str(fakes(tmp_path / "fakes", **kw)),
        "OUT": str(tmp_path / "out"),
        "W": str(tmp_path / "w"),
        "DEADLINE": str(deadline),
        "KERNELS": str(tmp_path / "kernels"),
    }


def run_check(tmp_path: Path, deadline: int = 540, script: Path = SCRIPT, **kw) -> tuple[str, Path, Path]:
    out, work = tmp_path / "out", tmp_path / "w"
    env = check_env(tmp_path, deadline, **kw)
    done = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, out, work


def commands(work: Path) -> dict[str, str]:
    """The command each step would have run (its log's first line)."""
    return {p.stem: p.read_text().splitlines()[0] for p in (work / "logs").glob("*.log") if p.read_text()}


def test_the_check_runs_every_step_in_order_and_summarizes_the_results(tmp_path):
    stdout, out, work = run_check(tmp_path)
    summary = (out / "summary.txt").read_text().splitlines()
    assert stdout.rstrip().endswith("files: " + " ".join(sorted(p.name for p in out.iterdir())))
    assert summary[0].startswith("GPU NVIDIA H100 80GB HBM3 torch 2.11.0+cu130 nvcc  13.0, V13.0.88 | d2d 1400.0 GB/s")
    assert summary[1] == "imports: flashinfer=ok, nixl._api=FAIL"
    steps = [line.split()[0] for line in summary if re.match(r"\w+ rc=\d+ ", line)]
    order = ["probe", "gen_models", "transfer_tests", "bench_nixl", "bench_mooncake", "gpu_tests", "fp8_gemm"]
    order += ["deterministic_tests", "parity"]
    assert steps == [*order, "roofline", "pd_ttft"]  # the failed bench did not stop the rest
    assert "bench_mooncake rc=1 " in "\n".join(summary) and any(line.startswith("jit=ok") for line in summary)
    assert "gpu_tests.log: 1 failed, 14 passed in 120.0s" in summary
    assert "transfer_tests.log: 3 passed in 41.0s" in summary
    assert "deterministic_tests.log: 1 failed, 5 passed in 40.0s" in summary  # and which parts held:
    assert "deterministic: chunked prefill (64) == one chunk: DIFFERS" in summary
    assert "deterministic: batch 8 == alone (graphs): held" in summary
    assert "kernels: 0 carried (" in "\n".join(summary)
    assert "kernels: 1 carried failed to load; JIT-built ['batch_decode_hd64']" in summary
    assert summary.index(next(s for s in summary if s.startswith("jit=ok"))) < summary.index(
        next(s for s in summary if s.startswith("bench_nixl rc="))
    )  # the transfer ratios: once no nvcc shares the CPU
    assert (
        "parity: 9 sizes of decode steps captured in 2.1 s, 310 MiB (402 MiB set aside before the KV pool)" in summary
    )
    assert (
        "roofline graphs vs eager greedy tokens: 63/64 requests equal over 3100 tokens, first diffs at [17]" in summary
    )
    assert any(
        re.match(r"transfer nixl +2k-prompt fragmented +45.0 MiB ours +1000.00 GB/s  /raw 0.91  /d2d 0.833", s)
        for s in summary
    )
    assert "parity flashinfer lp|max| 0.0100 top1 1.000 greedy full 2/2 gaps@diff []" in summary
    assert [s.split(" step ")[0] for s in summary if s.startswith("roofline flashinfer")] == [
        "roofline flashinfer graphs b=  1", "roofline flashinfer graphs b= 64", "roofline flashinfer eager  b=  1"
    ]  # fmt: skip
    assert "pd ttft ms {'mono': {'16': 9.0}, 'pd': {'16': 12.5}}  added {'16': 3.5}  greedy PD==mono [True]" in summary
    results = json.loads((out / "results.json").read_text())
    assert results["env"]["gpu"] == ENV["gpu"] and results["transfer"][1]["ratio_vs_raw"] == 0.96
    ran = commands(work)
    assert "--flashinfer" not in ran["parity"] and ran["parity"].endswith("flashinfer,torch")
    assert (
        "tests/gpu/test_cuda_graphs.py" in ran["gpu_tests"]
        and "tests/gpu/test_flashinfer_sampling.py" in ran["gpu_tests"]
    )


def test_every_file_a_step_names_is_in_the_checkout(tmp_path):
    _, _, work = run_check(tmp_path)
    named = {w for line in commands(work).values() for w in line.split() if re.match(r"(tests|benchmarks)/\S+\.py$", w)}
    assert len(named) >= 6 and all((ROOT / path).is_file() for path in named), named


def test_a_failed_kernel_build_runs_the_rest_on_torch_and_the_deadline_skips_what_is_left(tmp_path):
    _, out, work = run_check(tmp_path, jit_ok=False)
    assert "jit=failed" in (out / "summary.txt").read_text()
    assert commands(work)["parity"].endswith(" torch") and "flashinfer" not in commands(work)["roofline"]
    _, out, _ = run_check(tmp_path / "late", deadline=21, probe_seconds=2)
    lines = (out / "summary.txt").read_text().splitlines()
    assert any(line.startswith("probe rc=0 ") for line in lines)
    skipped = [line.split()[0] for line in lines if line.endswith("SKIPPED (deadline)")]
    assert skipped == [
        "gen_models",
        "transfer_tests",
        "bench_nixl",
        "bench_mooncake",
        "gpu_tests",
        "fp8_gemm",
        "deterministic_tests",
        "parity",
        "roofline",
        "pd_ttft",
    ]


def test_every_name_the_checks_programs_import_from_the_project_exists():
    """The probe, parity, roofline and TTFT programs the script writes import the project's modules: a
    rename in the code fails here, not in a lent GPU's minutes."""
    import importlib

    imports = re.findall(
        r"^from ((?:common|benchmarks|transfer|tandem)[\w.]*) import ([\w, ]+)$", SCRIPT.read_text(), re.M
    )
    assert len(imports) >= 8
    for module, names in imports:
        loaded = importlib.import_module(module)
        assert all(hasattr(loaded, n.strip()) for n in names.split(",")), (module, names)


def test_a_correctness_step_is_one_more_line_and_runs_after_the_existing_ones(tmp_path):
    """What a later CUDA path (quantized GEMMs, LoRA, deterministic kernels) adds: one line in CHECKS."""
    text = SCRIPT.read_text()
    line = "'quant_gemm 90 tests/gpu/test_quant_gemm.py'\n"
    assert text.count("\n)\nstep probe ") == 1
    script = tmp_path / "check.sh"
    script.write_text(text.replace("\n)\nstep probe ", "\n" + line + ")\nstep probe ", 1))
    _, out, work = run_check(tmp_path, script=script)
    steps = [line.split()[0] for line in (out / "summary.txt").read_text().splitlines() if re.match(r"\w+ rc=", line)]
    tail = ["gpu_tests", "fp8_gemm", "deterministic_tests", "quant_gemm", "parity"]
    assert steps[steps.index("gpu_tests") :][:5] == tail
    assert commands(work)["quant_gemm"].startswith("+ python3 -m pytest tests/gpu/test_quant_gemm.py -q ")
    assert "--timeout 70" in commands(work)["quant_gemm"]


def test_a_run_cut_short_keeps_the_summary_of_what_ran(tmp_path):
    """The device tool kills a command at its limit: summary.txt is rewritten after every step, so it is there."""
    env = check_env(tmp_path)
    (Path(env["TANDEM_GPU_CHECK_FAKES"]) / "roofline" / "seconds").write_text("60")
    run = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    summary, deadline = tmp_path / "out" / "summary.txt", time.monotonic() + 60
    try:
        while not (summary.exists() and "parity rc=0" in summary.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    lines = summary.read_text().splitlines()
    assert [line.split()[0] for line in lines if re.match(r"\w+ rc=", line)][-3:] == [
        "fp8_gemm",
        "deterministic_tests",
        "parity",
    ]
    assert "parity flashinfer lp|max| 0.0100 top1 1.000 greedy full 2/2 gaps@diff []" in lines
    assert json.loads((tmp_path / "out" / "results.json").read_text())["parity"] == PARITY


# What the GPU machine's image has (its `python3`: Python 3.12, torch 2.11 for CUDA 13; scripts/gpu/README.md),
# as import names, and what the check's bundle adds (check.sh prep's wheels, whose import names differ from the
# distributions' here and there).
IMAGE = {line.split("#")[0].strip() for line in (ROOT / "scripts/gpu/image-modules.txt").read_text().splitlines()} - {
    ""
}
IMPORT_NAMES = {
    "pyzmq": "zmq",
    "python-dotenv": "dotenv",
    "apache-tvm-ffi": "tvm_ffi",
    "flashinfer-python": "flashinfer",
}
IMPORT_NAMES |= {"mooncake-transfer-engine-cuda13": "mooncake", "nixl-cu13": "nixl_cu13"}


def bundled() -> set[str]:
    """The import names of the wheels `check.sh prep` puts in .gpu/site.tar.xz."""
    prep = SCRIPT.read_text().split('if [ "${1:-}" = prep ]', 1)[1].split("\nfi\n", 1)[0]
    dists = re.findall(r"([A-Za-z][\w.-]*)==[\w.]+", prep)
    return {IMPORT_NAMES.get(d, d.replace("-", "_")) for d in dists}


def engine_imports() -> set[str]:
    """The top-level modules an Engine may import: every import in the project's modules it reaches from
    common/engine/engine.py (function bodies too: CUDA-only paths such as FlashInfer import lazily)."""
    ours, seen, todo, found = {"common", "transfer", "tandem"}, set(), ["common.engine.engine"], set()
    while todo:
        name = todo.pop()
        path = next(
            (
                p
                for p in (ROOT / (name.replace(".", "/") + ".py"), ROOT / name.replace(".", "/") / "__init__.py")
                if p.is_file()
            ),
            None,
        )
        if path is None or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                (todo.append(n) if n.split(".")[0] in ours else found.add(n.split(".")[0]))
    return found - set(sys.stdlib_module_names) - {"__future__"}


def test_every_module_an_engine_imports_is_on_the_gpu_machine_or_in_the_bundle():
    found = engine_imports()
    assert {"torch", "transformers", "xgrammar", "flashinfer"} <= found  # the walk reaches the lazy imports
    assert found - IMAGE - bundled() == set()


def test_the_kernels_built_ahead_cover_every_shape_the_check_prewarms():
    """scripts/gpu/kernels.py builds FlashInfer's modules for SHAPES: the check's prewarm shapes are among them."""
    kernels = (ROOT / "scripts" / "gpu" / "kernels.py").read_text()
    shapes = set(ast.literal_eval(re.search(r"^SHAPES = (.+)$", kernels, re.M).group(1)))
    prewarmed = re.findall(r'"bfloat16 (\d+) (\d+) (\d+) (?:EXTEND|DECODE) \d+"', SCRIPT.read_text())
    assert len(prewarmed) == 3 and {tuple(map(int, s)) for s in prewarmed} <= shapes

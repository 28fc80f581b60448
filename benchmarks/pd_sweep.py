"""PD vs monolithic across request rates with `tandem bench`: starts a monolithic server and a PD cluster
(1 prefill + 1 decode + router, Mooncake TCP) side by side on this machine with the same engine flags,
then runs the same Poisson requests against both and writes the table, the JSON and the plots.

    .venv/bin/python benchmarks/pd_sweep.py [--rates 0.25 0.5 1 2] [--num-prompts 24] [--out docs/performance]
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import start_server  # noqa: E402
from tests.integration.cluster import start_cluster  # noqa: E402

ENGINE = ("--page-size", "16", "--chunked-prefill-size", "512", "--max-total-tokens", "32768")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["0.25", "0.5", "1", "2"])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "performance")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mono = start_server(*ENGINE, name="sweep-mono").wait_ready()
    pd = start_cluster("mooncake", flags=ENGINE)
    try:
        bench = [
            sys.executable,
            "-m",
            "tandem",
            "bench",
            "--backend",
            "sglang",
            "--base-url",
            pd.url,
            "--compare",
            mono.url,
            "--label",
            "PD (1P1D + router)",
            "--compare-label",
            "monolithic",
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--num-prompts",
            str(args.num_prompts),
            "--warmup-requests",
            "2",
            "--request-rate",
            *args.rates,
            "--goodput",
            "ttft:2000",
            "itl:500",
            "--disable-tqdm",
            "--output-json",
            str(args.out / "pd_vs_monolithic.json"),
            "--plot",
            str(args.out / "pd_vs_monolithic.png"),
        ]
        print("$", "python", shlex.join(bench[1:]), flush=True)
        subprocess.run(bench, cwd=ROOT, check=True)
    finally:
        pd.stop()
        mono.stop()


if __name__ == "__main__":
    main()

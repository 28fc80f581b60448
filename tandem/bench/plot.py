"""--plot: latency percentiles against request rate for each endpoint (top; with a single rate, bars per
endpoint), the TTFT and ITL distributions as CDFs for each endpoint and rate (middle), and for a
multi-turn run each turn's TTFT percentiles and cached prompt tokens (bottom), in one PNG."""

from __future__ import annotations

import math

import numpy as np

from tandem.bench.runner import RunResult
from tandem.bench.stats import PERCENTILES, latency_values

STYLES = {50: "-", 90: "--", 99: ":"}
COLORMAPS = ("Blues", "Oranges", "Greens", "Purples")  # one per endpoint; darker = higher request rate


def _x(run: RunResult) -> float:
    """The offered rate; an `inf` run (all at once) is drawn at the rate it achieved."""
    return run.summary["request_throughput"] if math.isinf(run.request_rate) else run.request_rate


def _color(runs: list[RunResult], run: RunResult, shade: float | None = None):
    """The run's endpoint's colormap, at `shade` or at the run's rank among the rates."""
    import matplotlib

    names = list(dict.fromkeys(r.endpoint.name for r in runs))
    rates = sorted(set(r.request_rate for r in runs))
    cmap = matplotlib.colormaps[COLORMAPS[names.index(run.endpoint.name) % len(COLORMAPS)]]
    return cmap(shade if shade is not None else 0.4 + 0.6 * (rates.index(run.request_rate) + 1) / len(rates))


def _percentile_bars(ax, runs: list[RunResult], name: str) -> None:
    """One rate: a group of bars per endpoint, one bar per percentile."""
    width = 0.8 / len(PERCENTILES)
    for i, run in enumerate(runs):
        for j, q in enumerate(PERCENTILES):
            value = run.summary[f"p{q}_{name}_ms"]
            ax.bar(
                i + (j - 1) * width, np.nan if value is None else value, width, color=_color(runs, run, 0.4 + 0.2 * j)
            )
            ax.text(i + (j - 1) * width, 0, f"p{q}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(runs)), [r.endpoint.name for r in runs], fontsize=8)
    ax.set_ylabel(f"{name.upper()} (ms)")
    ax.set_title(f"{name.upper()} p50/p90/p99 @ {_rate(runs[0])} req/s")
    ax.grid(alpha=0.3, axis="y")


def _rate(run: RunResult) -> str:
    return "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"


def _percentile_panel(ax, runs: list[RunResult], name: str) -> None:
    if len({r.request_rate for r in runs}) == 1:
        _percentile_bars(ax, runs, name)
        return
    for endpoint in dict.fromkeys(r.endpoint.name for r in runs):
        mine = sorted((r for r in runs if r.endpoint.name == endpoint), key=_x)
        for q in PERCENTILES:
            ys = [r.summary[f"p{q}_{name}_ms"] for r in mine]
            ax.plot(
                [_x(r) for r in mine],
                [np.nan if y is None else y for y in ys],
                STYLES[q],
                marker="o",
                color=_color(runs, mine[0], 0.8),
                label=f"{endpoint} p{q}",
            )
    ax.set_xlabel("request rate (req/s; 'inf' runs at the rate achieved)")
    ax.set_ylabel(f"{name.upper()} (ms)")
    ax.set_title(f"{name.upper()} percentiles vs request rate")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _cdf_panel(ax, runs: list[RunResult], name: str) -> None:
    for run in runs:
        values = np.sort(np.asarray(latency_values(run.outputs, name)) * 1000.0)
        if values.size:
            rate = _rate(run)
            ax.step(
                values,
                np.arange(1, values.size + 1) / values.size,
                where="post",
                color=_color(runs, run),
                label=f"{run.endpoint.name} @ {rate} req/s",
            )
    ax.set_xlabel(f"{name.upper()} (ms)")
    ax.set_ylabel("fraction of " + ("requests" if name == "ttft" else "token gaps"))
    ax.set_title(f"{name.upper()} CDF")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _turn_panel(ax, runs: list[RunResult], key: str, ylabel: str) -> None:
    """A multi-turn run's `key` per turn, one line per run (p50 solid, p99 dotted for TTFT)."""
    for run in runs:
        turns = run.summary["turns"]
        keys = [f"p{q}_ttft_ms" for q in (50, 99)] if key == "ttft" else [key]
        for k in keys:
            ys = [np.nan if t[k] is None else t[k] for t in turns]
            style = ":" if k.startswith("p99") else "-"
            label = f"{run.endpoint.name} @ {_rate(run)}" + (f" {k.split('_')[0]}" if key == "ttft" else "")
            ax.plot([t["turn"] for t in turns], ys, style, marker="o", color=_color(runs, run), label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} per turn")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot(runs: list[RunResult], path: str) -> None:
    """Write the figure of `runs` to `path` (PNG): 2x2, or 3x2 for a multi-turn run."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    multi_turn = all("turns" in r.summary for r in runs)
    fig, axes = plt.subplots(3 if multi_turn else 2, 2, figsize=(13, 13.5 if multi_turn else 9))
    _percentile_panel(axes[0][0], runs, "ttft")
    _percentile_panel(axes[0][1], runs, "itl")
    _cdf_panel(axes[1][0], runs, "ttft")
    _cdf_panel(axes[1][1], runs, "itl")
    if multi_turn:
        _turn_panel(axes[2][0], runs, "ttft", "TTFT (ms)")
        _turn_panel(axes[2][1], runs, "cached_tokens", "cached prompt tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""The numbers of one run, named as SGLang's and vLLM's benchmark JSON names them (mean_ttft_ms,
p99_itl_ms, output_throughput, request_goodput, ...). Percentiles interpolate linearly (numpy's default,
as both of those tools compute them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.bench.client import RequestOutput

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")


def distribution(name: str, seconds: list[float]) -> dict[str, float | None]:
    """mean and PERCENTILES of `seconds`, in ms; None when there are no values."""
    keys = [f"mean_{name}_ms"] + [f"p{q}_{name}_ms" for q in PERCENTILES]
    if not seconds:
        return dict.fromkeys(keys)
    ms = np.asarray(seconds, dtype=float) * 1000.0
    return dict(zip(keys, [float(ms.mean())] + [float(np.percentile(ms, q)) for q in PERCENTILES]))


def tpot(o: RequestOutput) -> float | None:
    """Time per output token after the first, in seconds; None for a single-token output."""
    return (o.latency - o.ttft) / (o.output_len - 1) if o.output_len > 1 else None


def latency_values(outputs: list[RequestOutput], name: str) -> list[float]:
    """Every value of latency `name` (seconds) over the successful requests; ITL pools all their gaps."""
    ok = [o for o in outputs if o.success]
    if name == "ttft":
        return [o.ttft for o in ok]
    if name == "itl":
        return [gap for o in ok for gap in o.itl]
    if name == "e2e_latency":
        return [o.latency for o in ok]
    return [t for t in map(tpot, ok) if t is not None]


def meets_slos(o: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a request finished within every objective; for itl that is its longest gap between tokens."""
    if not o.success:
        return False
    value_s = {"ttft": o.ttft, "itl": max(o.itl, default=0.0), "tpot": tpot(o) or 0.0, "e2e_latency": o.latency}
    return all(value_s[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(outputs: list[RequestOutput], duration: float, slos_ms: dict[str, float]) -> dict[str, Any]:
    """Counts, throughputs (per second of `duration`), goodput under `slos_ms`, latency distributions."""
    ok = [o for o in outputs if o.success]
    total_in, total_out = sum(o.prompt_len for o in ok), sum(o.output_len for o in ok)
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    res: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
    }
    if slos_ms:
        good = sum(meets_slos(o, slos_ms) for o in outputs)
        res |= {"request_goodput": good / duration, "slo_attainment": good / len(outputs)}
    for name in LATENCIES:
        res |= distribution(name, latency_values(outputs, name))
    errors = [o.error for o in outputs if not o.success]
    if errors:
        res["first_error"] = errors[0]
    return res

"""What the forwards of a server cost, measured: per kind of batch (extend: prompt chunks; decode: one token per
running request) the steps run, the tokens they computed and the seconds they took, as counters
(`tandem_forward_{steps,tokens,seconds}_total{mode}`), and the start-up measurement taken after the warm-up
(`tandem_calibration_*`: a prompt's tokens per second, one decode step's seconds). The router prices where a
prompt is computed with them (router/placement/worker_stats.py, docs/placement.md): the calibration until the counters move,
then their rates.

The scheduler thread records; the /metrics thread reads (a float read is atomic).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

MODES = ("extend", "decode")


@dataclass
class Calibration:
    """The start-up measurement: one prompt of `tokens` tokens and one decode step, timed after the warm-up."""

    tokens: int = 0
    prefill_s: float = 0.0
    decode_step_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "decode_step_s": round(self.decode_step_s, 6),
        }


class ForwardStats:
    """A Prometheus collector of the forward counters and the calibration (register it with the engine's registry)."""

    def __init__(self) -> None:
        self.steps = dict.fromkeys(MODES, 0)
        self.tokens = dict.fromkeys(MODES, 0)
        self.seconds = dict.fromkeys(MODES, 0.0)
        self.calibration = Calibration()
        self.chunk_tokens = 0  # the server's prefill chunk (--chunked-prefill-size, else the batch budget)

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        self.steps[mode] += 1
        self.tokens[mode] += tokens
        self.seconds[mode] += seconds

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for what, doc in (
            ("steps", "forwards run, by mode (extend: prompt chunks; decode: one token per running request)"),
            ("tokens", "tokens the forwards computed, by mode"),
            ("seconds", "seconds the forwards took, by mode"),
        ):
            family = CounterMetricFamily(f"tandem_forward_{what}", doc, labels=["mode"])
            for mode, value in getattr(self, what).items():
                family.add_metric([mode], value)
            yield family
        c = self.calibration
        yield GaugeMetricFamily(
            "tandem_calibration_prefill_tokens_per_second",
            f"prompt tokens per second of one {c.tokens}-token prefill timed at start-up",
            value=c.prefill_tokens_per_s,
        )
        yield GaugeMetricFamily(
            "tandem_calibration_decode_step_seconds",
            "one decode step's seconds, timed at start-up",
            value=c.decode_step_s,
        )
        yield GaugeMetricFamily(
            "tandem_prefill_chunk_tokens",
            "the most prompt tokens of one request in one forward",
            value=self.chunk_tokens,
        )

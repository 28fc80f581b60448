"""What a client's headers ask of a request's placement (docs/placement.md):

    x-bypass-remote-prefill: true     compute the prompt on the decode (Dynamo's name)
    x-slo-ttft-ms: 500                its time-to-first-token target (llm-d's names)
    x-slo-tpot-ms: 50                 its time-per-output-token target
    x-prefiller-host-port: HOST:PORT  the prefill a gateway's endpoint picker chose (llm-d's name): the pair
                                      sidecar (router/epp/sidecar.py) pairs its decode with it

A bad value is a 400 naming the header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.wire.errors import InvalidRequest

BYPASS = "x-bypass-remote-prefill"
TTFT = "x-slo-ttft-ms"
TPOT = "x-slo-tpot-ms"
PREFILLER = "x-prefiller-host-port"
TRUE, FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no"})


@dataclass(frozen=True)
class RequestHints:
    bypass_remote_prefill: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    prefiller: str | None = None  # HOST:PORT

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> RequestHints:
        bypass = headers.get(BYPASS)
        if bypass is not None and bypass.strip().lower() not in TRUE | FALSE:
            raise InvalidRequest(f"header {BYPASS}: {bypass!r} is not true or false", param=BYPASS)
        return cls(
            bypass is not None and bypass.strip().lower() in TRUE,
            _milliseconds(headers, TTFT),
            _milliseconds(headers, TPOT),
            _host_port(headers),
        )

    def priority(self) -> int | None:
        """The request's priority from its TTFT target (--slo-priority): tighter targets first, above requests
        without one (priority 0); None without a target."""
        if self.ttft_s is None:
            return None
        return max(1, round(1000 / self.ttft_s))  # 1 s: 1000; 100 ms: 10000; 10 s: 100


NONE = RequestHints()


def _milliseconds(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not 0 < ms < 86_400_000:  # also NaN
        raise InvalidRequest(f"header {name}: {raw!r} is not a number of milliseconds > 0", param=name)
    return ms / 1000


def _host_port(headers: Mapping[str, str]) -> str | None:
    raw = headers.get(PREFILLER)
    if raw is None:
        return None
    host, _, port = raw.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in "/@ "):
        raise InvalidRequest(f"header {PREFILLER}: {raw!r} is not HOST:PORT", param=PREFILLER)
    return raw.strip()

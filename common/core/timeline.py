"""Per-request timeline: when each step of a request happened, for finding where latency goes.

Any thread marks an event on the request's Timeline (the HTTP side, the scheduler, the transfer
threads through the room they serve). When the request's stream ends, `report()` logs one DEBUG line
on the `tandem.timeline` logger and observes every event in the histogram
`tandem_request_span_seconds{span=EVENT}`: the seconds from the request's arrival at this server to the
event (to its last occurrence, for events that repeat, such as a chunk written).

Events, in the order a request meets them:

    every role  arrival, admitted, prefill_start, forward_done, first_token_committed, first_token_streamed
    PD prefill  room_request_received (the decode's page ids), first_token_sent (its aux record, ahead of
                the KV), chunk_queued, chunk_written, aux_written, status_sent
    PD decode   peer_found, pages_reserved, room_request_sent, status_received

The log line carries the arrival as an absolute time.monotonic() value, so that on one host the
timelines of a request's two halves (and the client's own clock) can be lined up: `parse()` reads it.
"""

from __future__ import annotations

import logging
import re
import time

log = logging.getLogger("tandem.timeline")
_LINE = re.compile(r"timeline rid=(\S+) t0=([0-9.]+) (.*)$")


class Timeline:
    """Monotonic timestamps of one request's events; appends are atomic, so any thread may mark."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def mark(self, event: str, at: float | None = None) -> None:
        self.events.append((event, time.monotonic() if at is None else at))

    def mark_once(self, event: str) -> None:
        """Mark `event` unless it happened already (the first forward of a chunked prompt)."""
        if all(name != event for name, _ in self.events):
            self.mark(event)

    def offsets(self, t0: float) -> dict[str, float]:
        """Seconds from `t0` to the last occurrence of each event."""
        return {name: at - t0 for name, at in sorted(self.events, key=lambda e: e[1])}


def report(rid: str, arrival: float, timeline: Timeline, histogram) -> None:
    """Log the timeline (DEBUG) and observe each event's offset from `arrival` in `histogram` (labelled by span)."""
    if log.isEnabledFor(logging.DEBUG):
        events = sorted(timeline.events, key=lambda e: e[1])
        steps = " ".join(f"{name}=+{1000 * (at - arrival):.2f}" for name, at in events)
        log.debug("timeline rid=%s t0=%.6f %s", rid, arrival, steps)
    if histogram is not None:
        for name, offset in timeline.offsets(arrival).items():
            histogram.labels(name).observe(max(offset, 0.0))


def parse(line: str) -> tuple[str, float, list[tuple[str, float]]] | None:
    """(rid, arrival, [(event, absolute monotonic time)]) of a line `report()` logged, else None."""
    m = _LINE.search(line)
    if m is None:
        return None
    t0 = float(m.group(2))
    events = []
    for step in m.group(3).split():
        name, _, ms = step.partition("=+")
        events.append((name, t0 + float(ms) / 1000))
    return m.group(1), t0, events

"""Helpers for fault-injection tests: requests run in the background with their timings, SSE
streams read event by event, and polls of server state with a deadline."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.conftest import ServerProcess, metric


@dataclass
class Outcome:
    status: int | None = None
    body: dict | list | None = None
    events: list[dict] = field(default_factory=list)  # streaming: every data event, parsed
    done_marker: bool = False  # streaming: the stream ended with data: [DONE]
    error: str | None = None  # streaming error event's message, or a transport error
    ended_at: float | None = None
    first_event_at: float | None = None

    @property
    def output_ids(self) -> list[int] | None:
        if self.events:
            return self.events[-1].get("output_ids")
        return self.body.get("output_ids") if isinstance(self.body, dict) else None

    @property
    def error_message(self) -> str:
        if self.error:
            return self.error
        return self.body.get("error", {}).get("message", "") if isinstance(self.body, dict) else ""


class Background:
    """A request running on its own thread; `outcome` fills in as it progresses."""

    def __init__(self, url: str, body: dict, timeout: float = 120.0):
        self.outcome = Outcome()
        self._thread = threading.Thread(target=self._run, args=(url, body, timeout), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict, timeout: float) -> None:
        o = self.outcome
        try:
            if body.get("stream"):
                self._stream(url, body, timeout)
            else:
                r = httpx.post(url + "/generate", json=body, timeout=timeout)
                o.status, o.body = r.status_code, r.json()
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            o.error = f"transport: {e!r}"
        o.ended_at = time.monotonic()

    def _stream(self, url: str, body: dict, timeout: float) -> None:
        o = self.outcome
        with httpx.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
            o.status = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    o.done_marker = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        o.error = event["error"]["message"]
                    else:
                        o.first_event_at = o.first_event_at or time.monotonic()
                        o.events.append(event)

    def wait(self, timeout: float = 120.0) -> Outcome:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"request still running after {timeout} s: it hung"
        return self.outcome


class RawClient:
    """HTTP/1.1 over a bare socket, so a test can drop the connection at the moment it chooses (an HTTP
    client library would block until the response headers came)."""

    def __init__(self, server: ServerProcess, path: str, body: dict):
        data = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.received:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed before {marker!r}: {self.received!r}"
            self.received += chunk
        return self.received

    def close(self) -> None:
        self.sock.close()


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll until `check()` is true; returns the time it took, fails the test after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def chunks_sent(node: ServerProcess) -> float:
    return metric(node.url, "tandem_kv_transfer_events_total", event="chunks_sent")


def finished(node: ServerProcess, reason: str) -> float:
    return metric(node.url, "tandem_requests_finished_total", reason=reason)


def router_sees(router_url: str, node: ServerProcess, healthy: bool) -> bool:
    workers = httpx.get(router_url + "/workers", timeout=5).json()["workers"]
    return any(w["url"] == node.url and w["healthy"] == healthy for w in workers)


def pages_held(node: ServerProcess) -> int:
    pages = node.info()["kv_pages"]
    return pages["in_use"] + pages["locked"]

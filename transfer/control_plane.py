"""The control plane's transport: one ZMQ PULL socket bound to a random port (read by the `kv-recv`
thread), one PUSH socket per peer endpoint, every frame signed and stamped by transfer/messages.py.

Sends never block: a peer that stopped reading long ago fills its socket's queue and later sends are
dropped and counted (the heartbeat declares that peer dead). A connection that hears nothing back (ZMTP
heartbeats) for `stall_s`, or a connect that has not finished in `stall_s`, is closed and dialled again:
after a network partition heals, frames flow at once instead of waiting out TCP's retransmission backoff,
which doubles up to seconds while the partition lasts. Frames a replaced connection still carried may
arrive late; the receiver drops them as replays (transfer/messages.py). A receive handler that raises never stops
the loop: the frame is counted as rejected and the cause logged.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from transfer.messages import encode, next_seq

log = logging.getLogger(__name__)
FrameHandler = Callable[[bytes], None]


class ZmqControlPlane:
    def __init__(self, host: str, sender_id: str, secret: str | None, counters: Counter, stall_s: float = 5.0):
        self.sender_id, self.secret, self.counters = sender_id, secret, counters
        self.stall_ms = max(1, int(stall_s * 1000))
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_frame: FrameHandler) -> None:
        self._thread = threading.Thread(target=self._recv_loop, args=(on_frame,), name="kv-recv", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive() or self._stop.is_set()

    def send(self, endpoint: str, msg: Any) -> None:
        """Sign, stamp and queue `msg` for `endpoint` (under one lock, so sequence numbers go out in order)."""
        with self._lock:
            if self._stop.is_set():
                return  # closed: the process is leaving
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._push[endpoint] = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 100000)
                sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, self.stall_ms // 2))
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.stall_ms)
                sock.setsockopt(zmq.CONNECT_TIMEOUT, self.stall_ms)
                sock.connect(endpoint)
            frame = encode(msg, self.secret, sender=self.sender_id, seq=next_seq())
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.Again:  # the peer stopped reading long ago; the heartbeat will say so
                self.counters["dropped_sends"] += 1

    def drop(self, endpoint: str) -> None:
        """Close the socket to `endpoint`, discarding what it still queues (the peer was declared dead)."""
        with self._lock:
            sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def _recv_loop(self, on_frame: FrameHandler) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(100):
                    on_frame(self._pull.recv())
            except Exception:  # a bug in one frame's handling must not stop the control plane
                self.counters["rejected_messages"] += 1
                log.exception("control-plane receive loop: a frame could not be handled")

    def close(self) -> None:
        """Stop reading and close every socket without lingering (the process is leaving)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        with self._lock:
            socks, self._push = list(self._push.values()), {}
        for sock in socks:
            sock.close(linger=0)
        if self._thread is None or not self._thread.is_alive():
            self._pull.close(linger=0)
            self._ctx.term()

"""Signed bootstrap requests: the cluster secret signs each registration and lookup, as it signs the
control frames (transfer/messages.py), and never crosses the wire itself.

    X-Tandem-Signature: v1 ts=<sender's time.time()> nonce=<32 hex digits> mac=<64 hex digits>
    mac = HMAC-SHA256(secret, "v1\\n" METHOD "\\n" raw path with query "\\n" ts "\\n" nonce "\\n" body)

The receiver refuses (401, naming why) a request without the header, with a header it cannot parse, with a
MAC that does not match, sent more than REPLAY_WINDOW_S from its own clock (stale), or whose nonce it has
accepted before within that window (a replay). Nonces, not sequence numbers: a decode's lookups run on
several threads at once and may arrive out of order.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

SIGNATURE_HEADER = "X-Tandem-Signature"
REPLAY_WINDOW_S = 300.0  # the control frames' window: a request sent further from now is stale
MAX_NONCES = 1 << 17  # nonces remembered; beyond this the oldest is forgotten and requests as old are stale
HEADER = re.compile(r"v1 ts=([0-9]{1,12}\.[0-9]{1,9}) nonce=([0-9a-f]{32}) mac=([0-9a-f]{64})")


class SignatureError(ValueError):
    """A request whose signature is refused; the message says why."""


def _request_mac(secret: str, method: str, raw_path: str, ts: str, nonce: str, body: bytes) -> str:
    head = f"v1\n{method.upper()}\n{raw_path}\n{ts}\n{nonce}\n".encode("utf-8", "surrogatepass")
    return hmac.new(secret.encode(), head + body, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, raw_path: str, body: bytes = b"", now: float | None = None) -> str:
    """The X-Tandem-Signature value of one request (`raw_path`: path and query exactly as sent)."""
    ts = f"{time.time() if now is None else now:.6f}"
    nonce = secrets.token_hex(16)
    return f"v1 ts={ts} nonce={nonce} mac={_request_mac(secret, method, raw_path, ts, nonce, body)}"


class SignatureGuard:
    """Verifies signatures and accepts each nonce once within REPLAY_WINDOW_S. Thread-safe."""

    def __init__(self, secret: str, window_s: float = REPLAY_WINDOW_S, clock: Callable[[], float] = time.time):
        self.secret, self.window_s, self.clock = secret, window_s, clock
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> its request's ts, in arrival order
        self._floor = 0.0  # requests sent at or before this are refused: their nonces may be forgotten
        self._lock = threading.Lock()

    def check(self, header: str | None, method: str, raw_path: str, body: bytes) -> None:
        """Returns when the request is signed with the secret, fresh and new; SignatureError otherwise."""
        if not header:
            raise SignatureError(f"unsigned request: no {SIGNATURE_HEADER} header (the sender has no cluster secret)")
        m = HEADER.fullmatch(header)
        if m is None:
            raise SignatureError(f"malformed {SIGNATURE_HEADER} header (want 'v1 ts=... nonce=... mac=...')")
        ts, nonce, mac = m.groups()
        if not hmac.compare_digest(mac, _request_mac(self.secret, method, raw_path, ts, nonce, body)):
            raise SignatureError("signature does not match (wrong cluster secret, or the request was altered)")
        sent_at, now = float(ts), self.clock()
        if abs(now - sent_at) > self.window_s:
            raise SignatureError(
                f"stale request: signed {now - sent_at:.0f} s ago (a replay, or clocks out of sync by more "
                f"than {self.window_s:.0f} s)"
            )
        self._accept_once(nonce, sent_at, now)

    def _accept_once(self, nonce: str, sent_at: float, now: float) -> None:
        with self._lock:
            if nonce in self._nonces or sent_at <= self._floor:
                raise SignatureError("replayed request: this signature was accepted before")
            self._nonces[nonce] = sent_at
            while self._nonces:  # forget what the stale check refuses anyway, and the oldest beyond the cap
                oldest, oldest_ts = next(iter(self._nonces.items()))
                if len(self._nonces) <= MAX_NONCES and now - oldest_ts <= self.window_s:
                    break
                del self._nonces[oldest]
                if len(self._nonces) >= MAX_NONCES:
                    self._floor = max(self._floor, oldest_ts)

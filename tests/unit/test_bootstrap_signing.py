"""The bootstrap's request signatures (bootstrap/signing.py) on an injected clock: what is accepted once,
what is refused and why, and that forgetting nonces beyond the cap never lets a replay through."""

from __future__ import annotations

import pytest

from bootstrap import signing
from bootstrap.signing import SignatureError, SignatureGuard, sign

SECRET = "unit-secret"
NOW = 1_800_000_000.0


def guard() -> SignatureGuard:
    return SignatureGuard(SECRET, clock=lambda: NOW)


def test_a_signed_request_is_accepted_once():
    g, header = guard(), sign(SECRET, "PUT", "/route", b"{}", now=NOW)
    g.check(header, "PUT", "/route", b"{}")
    with pytest.raises(SignatureError, match="replayed"):
        g.check(header, "PUT", "/route", b"{}")


@pytest.mark.parametrize(
    "method,path,body,why",
    [
        ("GET", "/route", b"{}", "does not match"),  # another method
        ("PUT", "/route?instance_id=x", b"{}", "does not match"),  # another query
        ("PUT", "/route", b"{ }", "does not match"),  # another body
    ],
)
def test_the_signature_covers_method_path_query_and_body(method, path, body, why):
    with pytest.raises(SignatureError, match=why):
        guard().check(sign(SECRET, "PUT", "/route", b"{}", now=NOW), method, path, body)


@pytest.mark.parametrize("offset", [-300.5, 300.5])
def test_outside_the_window_is_stale(offset):
    with pytest.raises(SignatureError, match="stale"):
        guard().check(sign(SECRET, "GET", "/route", now=NOW + offset), "GET", "/route", b"")


def test_the_secret_is_not_in_the_header():
    header = sign(SECRET, "GET", "/route", now=NOW)
    assert SECRET not in header and SECRET.encode().hex() not in header


def test_forgetting_the_oldest_nonce_beyond_the_cap_refuses_its_replay(monkeypatch):
    monkeypatch.setattr(signing, "MAX_NONCES", 3)
    g = guard()
    headers = [sign(SECRET, "GET", "/route", now=NOW - 10 + i) for i in range(5)]
    for h in headers:
        g.check(h, "GET", "/route", b"")
    for h in headers:  # the first two were forgotten: they are refused as older than what was forgotten
        with pytest.raises(SignatureError, match="replayed"):
            g.check(h, "GET", "/route", b"")
    g.check(sign(SECRET, "GET", "/route", now=NOW), "GET", "/route", b"")  # a new request still passes

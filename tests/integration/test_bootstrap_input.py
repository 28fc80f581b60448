"""A standalone bootstrap process (`tandem bootstrap --cluster-secret`) refuses every bad registration
and lookup with a JSON error naming the field, counts it in /metrics and keeps serving. Requests here are
signed with the secret (bootstrap/signing.py) unless the test is about the signature."""

from __future__ import annotations

import gzip
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bootstrap.app import start_in_thread
from bootstrap.registry import DEFAULTS
from bootstrap.signing import SIGNATURE_HEADER, sign
from common.engine.metrics import EngineMetrics
from common.wire.kv_layout import LAYOUT_KEYS
from tests.conftest import ServerProcess, free_port, sample

SECRET = "s3cret-for-tests"
VALID = {
    "role": "Prefill",
    "instance_id": "prefill-a",
    "tp_size": 2,
    "tp_rank": 1,
    "dp_size": 1,
    "dp_rank": 0,
    "rank_ip": "10.0.0.7",
    "rank_port": 17000,
    "page_size": 16,
    "num_layers": 30,
    "kv_heads": 3,
    "head_dim": 64,
    "dtype": "bfloat16",
    "transfer_backend": "mooncake",
    "model_id": "0123456789abcdef",
    "attention": "mla",
    "kv_scales": "k=1,v=1",
    "speculative": "none",
    "kv_checksum": False,
    "weights": "none",
    "experts": "",
    "deterministic": False,
}
REQUIRED = [f for f in VALID if f not in DEFAULTS]  # what a registration may leave out
INT_FIELDS = [f for f, v in VALID.items() if isinstance(v, int) and not isinstance(v, bool)]
STR_FIELDS = [f for f, v in VALID.items() if isinstance(v, str)]


@pytest.fixture(scope="module")
def bootstrap():
    port = free_port()
    s = ServerProcess(["bootstrap", "--port", str(port), "--cluster-secret", SECRET], port, name="bootstrap")
    yield s.wait_ready(timeout=60)
    s.stop()


def rejected(server, field: str, method: str | None = None) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    if method is None:
        return sample(text, "tandem_bootstrap_rejected_registrations_total", {"field": field, "role": "bootstrap"})
    return sample(
        text, "tandem_bootstrap_rejected_lookups_total", {"method": method, "field": field, "role": "bootstrap"}
    )


def assert_error(r: httpx.Response, status: int, param: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert (err["code"], err["param"]) == (status, param)
    assert err["message"]


def signed(
    bootstrap, method: str, path_qs: str, content: bytes = b"", headers: dict | None = None, secret: str = SECRET
) -> httpx.Response:
    """`method path_qs` with `content`, signed with `secret` over exactly what is sent."""
    signature = {SIGNATURE_HEADER: sign(secret, method, path_qs, content)}
    return httpx.request(
        method, bootstrap.url + path_qs, content=content, headers=(headers or {}) | signature, timeout=10
    )


def without(field: str) -> dict:
    return {k: v for k, v in VALID.items() if k != field}


BAD_REGISTRATIONS = [
    pytest.param(b"{not json", 400, "body", id="not-json"),
    pytest.param(b'{"role": "Prefill"', 400, "body", id="truncated-json"),
    pytest.param(b'{"role": "\xff\xfe"}', 400, "body", id="not-utf8"),
    pytest.param(b"1" * 5000, 400, "body", id="5000-digit-int"),
    pytest.param(b"[" * 20000 + b"]" * 20000, 400, "body", id="deeply-nested"),
    pytest.param([VALID], 400, "body", id="json-array"),
    pytest.param("Prefill", 400, "body", id="json-string"),
    *[pytest.param(without(f), 400, f, id=f"missing-{f}") for f in REQUIRED],
    *[pytest.param(VALID | {f: None}, 400, f, id=f"null-{f}") for f in REQUIRED],
    *[pytest.param(VALID | {f: str(VALID[f])}, 400, f, id=f"string-{f}") for f in INT_FIELDS],
    *[pytest.param(VALID | {f: True}, 400, f, id=f"bool-{f}") for f in INT_FIELDS],
    *[pytest.param(VALID | {f: float(VALID[f])}, 400, f, id=f"float-{f}") for f in INT_FIELDS],
    *[pytest.param(VALID | {f: 7}, 400, f, id=f"int-{f}") for f in STR_FIELDS],
    *[pytest.param(VALID | {f: "x" * 256}, 400, f, id=f"long-{f}") for f in STR_FIELDS],
    pytest.param(VALID | {"rank_port": 0}, 400, "rank_port", id="port-0"),
    pytest.param(VALID | {"rank_port": 65536}, 400, "rank_port", id="port-65536"),
    pytest.param(VALID | {"rank_port": 10**30}, 400, "rank_port", id="port-huge"),
    pytest.param(VALID | {"tp_rank": 2}, 400, "tp_rank", id="tp-rank-not-below-size"),
    pytest.param(VALID | {"tp_rank": -1}, 400, "tp_rank", id="tp-rank-negative"),
    pytest.param(VALID | {"dp_rank": 1}, 400, "dp_rank", id="dp-rank-not-below-size"),
    pytest.param(VALID | {"tp_size": 0}, 400, "tp_size", id="tp-size-0"),
    pytest.param(VALID | {"page_size": -16}, 400, "page_size", id="page-size-negative"),
    pytest.param(VALID | {"rank_ip": ""}, 400, "rank_ip", id="empty-ip"),
    pytest.param(VALID | {"role": "Decode"}, 400, "role", id="role-decode"),
    pytest.param(VALID | {"role": "prefill"}, 400, "role", id="role-lowercase"),
    pytest.param(VALID | {"padding": "x" * 70_000}, 413, "body", id="oversize"),
]


@pytest.mark.parametrize("body,status,param", BAD_REGISTRATIONS)
def test_bad_registration_is_refused_naming_the_field_and_counted(bootstrap, body, status, param):
    before = rejected(bootstrap, param)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = signed(bootstrap, "PUT", "/route", raw, {"content-type": "application/json"})
    assert_error(r, status, param)
    assert rejected(bootstrap, param) == before + 1
    assert httpx.get(bootstrap.url + "/health", timeout=5).status_code == 200


def test_oversize_chunked_registration_is_413(bootstrap):
    before = rejected(bootstrap, "body")
    chunks = (b" " * 8192 for _ in range(10))  # no Content-Length: the limit must hold anyway
    r = httpx.put(bootstrap.url + "/route", content=chunks, timeout=10)  # refused before its signature is checked
    assert_error(r, 413, "body")
    assert rejected(bootstrap, "body") == before + 1


def test_compressed_registration_is_415(bootstrap):
    before = rejected(bootstrap, "content-encoding")
    body = gzip.compress(json.dumps(VALID).encode())
    r = signed(bootstrap, "PUT", "/route", body, {"content-type": "application/json", "content-encoding": "gzip"})
    assert_error(r, 415, "content-encoding")
    assert rejected(bootstrap, "content-encoding") == before + 1


def forged_signature(raw: bytes) -> str:
    """A well-formed signature of this request made with a guessed secret."""
    return sign("guessed-secret", "PUT", "/route", raw)


def altered_signature(raw: bytes) -> str:
    """The right secret's signature of a different body (a registration whose address was changed in flight)."""
    return sign(SECRET, "PUT", "/route", raw.replace(b"10.0.0.7", b"10.6.6.6"))


def stale_signature(raw: bytes) -> str:
    return sign(SECRET, "PUT", "/route", raw, now=time.time() - 301)


def future_signature(raw: bytes) -> str:
    return sign(SECRET, "PUT", "/route", raw, now=time.time() + 301)


@pytest.mark.parametrize(
    "headers,why",
    [
        pytest.param(lambda raw: {}, "unsigned", id="unsigned"),
        pytest.param(lambda raw: {"X-Tandem-Secret": SECRET}, "unsigned", id="the-secret-itself-is-not-accepted"),
        pytest.param(lambda raw: {SIGNATURE_HEADER: "v1 ts=1 nonce=00 mac=00"}, "malformed", id="malformed"),
        pytest.param(lambda raw: {SIGNATURE_HEADER: forged_signature(raw)}, "does not match", id="forged"),
        pytest.param(lambda raw: {SIGNATURE_HEADER: altered_signature(raw)}, "does not match", id="altered-body"),
        pytest.param(lambda raw: {SIGNATURE_HEADER: stale_signature(raw)}, "stale", id="stale"),
        pytest.param(lambda raw: {SIGNATURE_HEADER: future_signature(raw)}, "stale", id="from-the-future"),
    ],
)
def test_registration_not_signed_with_the_secret_is_401_naming_why(bootstrap, headers, why):
    before = rejected(bootstrap, "signature")
    raw = json.dumps(VALID).encode()
    r = httpx.put(bootstrap.url + "/route", content=raw, headers=headers(raw), timeout=10)
    assert_error(r, 401, "signature")
    assert r.json()["error"]["type"] == "authentication_error"
    assert why in r.json()["error"]["message"]
    assert rejected(bootstrap, "signature") == before + 1


@pytest.mark.parametrize("method,path_qs", [("PUT", "/route"), ("GET", "/route?engine_rank=1&target_dp_group=0")])
def test_a_replayed_request_is_401(bootstrap, method, path_qs):
    raw = json.dumps(VALID).encode() if method == "PUT" else b""
    headers = {SIGNATURE_HEADER: sign(SECRET, method, path_qs, raw)}
    first = httpx.request(method, bootstrap.url + path_qs, content=raw, headers=headers, timeout=10)
    assert first.status_code == 200, first.text
    again = httpx.request(method, bootstrap.url + path_qs, content=raw, headers=headers, timeout=10)
    assert_error(again, 401, "signature")
    assert "replayed" in again.json()["error"]["message"]


def test_a_signature_is_bound_to_its_query(bootstrap):
    """A lookup's signature does not authorize another lookup (or a DELETE of the same instance)."""
    good = sign(SECRET, "GET", "/route?engine_rank=1&target_dp_group=0")
    for method, path_qs in (("GET", "/route?engine_rank=0&target_dp_group=0"), ("DELETE", "/route?engine_rank=1")):
        r = httpx.request(method, bootstrap.url + path_qs, headers={SIGNATURE_HEADER: good}, timeout=10)
        assert_error(r, 401, "signature")


def test_valid_registration_after_bad_ones_is_returned_exactly(bootstrap):
    assert signed(bootstrap, "PUT", "/route", json.dumps(VALID).encode()).json() == {"ok": True}
    r = signed(bootstrap, "GET", "/route?engine_rank=1&target_dp_group=0")
    assert r.status_code == 200
    assert r.json() == VALID
    layout = signed(bootstrap, "GET", "/route?engine_rank=-1&target_dp_group=-1")
    assert layout.json() == {k: VALID[k] for k in ("tp_size", "dp_size", *LAYOUT_KEYS)}
    metrics = httpx.get(bootstrap.url + "/metrics", timeout=10).text
    assert sample(metrics, "tandem_bootstrap_registered_ranks", {"role": "bootstrap"}) == 1


@pytest.mark.parametrize("method", ["GET", "DELETE"])
@pytest.mark.parametrize(
    "query,param",
    [
        pytest.param("engine_rank=abc", "engine_rank", id="rank-abc"),
        pytest.param("engine_rank=1.0", "engine_rank", id="rank-float"),
        pytest.param("engine_rank=1_0", "engine_rank", id="rank-underscore"),
        pytest.param("engine_rank=", "engine_rank", id="rank-empty"),
        pytest.param("engine_rank=-2", "engine_rank", id="rank-negative"),
        pytest.param("engine_rank=0&target_dp_group=x", "target_dp_group", id="dp-x"),
        pytest.param("engine_rank=-1&target_dp_group=0", "engine_rank", id="half-layout-query"),
        pytest.param("engine_rank=99999999999999999999999", "engine_rank", id="rank-huge"),
    ],
)
def test_malformed_route_query_is_400_naming_the_field(bootstrap, method, query, param):
    before = rejected(bootstrap, param, method)
    r = signed(bootstrap, method, f"/route?{query}")
    assert_error(r, 400, param)
    assert rejected(bootstrap, param, method) == before + 1


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_lookup_or_removal_signed_with_a_wrong_secret_is_401_and_counted(bootstrap, method):
    before = rejected(bootstrap, "signature", method)
    r = signed(bootstrap, method, "/route?engine_rank=1", secret="wrong")
    assert_error(r, 401, "signature")
    assert rejected(bootstrap, "signature", method) == before + 1
    assert signed(bootstrap, "GET", "/route?engine_rank=1").status_code in (200, 404)  # still serves


def test_unknown_path_and_method_are_json_errors(bootstrap):
    assert_error(httpx.get(bootstrap.url + "/nope", timeout=10), 404, "path")
    assert_error(signed(bootstrap, "POST", "/route", json.dumps(VALID).encode()), 405, "method")


def test_embedded_registry_reports_its_rejections_to_the_engine_metrics():
    port = free_port()
    registry = start_in_thread("127.0.0.1", port, None)
    metrics = EngineMetrics("prefill")
    metrics.add_rejection_source("bootstrap", lambda: registry.rejected)
    for body in (b"nope", b"[]"):
        assert httpx.put(f"http://127.0.0.1:{port}/route", content=body, timeout=10).status_code == 400
    text = metrics.render().decode()
    assert sample(text, "tandem_rejected_inputs_total", {"where": "bootstrap", "role": "prefill"}) == 2
    assert sample(text, "tandem_rejected_inputs_total", {"where": "http", "role": "prefill"}) == 0
    assert [f.name for f in text_string_to_metric_families(text)].count("tandem_rejected_inputs") == 1

"""A standalone bootstrap process (`tandem bootstrap --cluster-secret`) refuses every bad registration
and lookup with a JSON error naming the field, counts it in /metrics and keeps serving."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bootstrap.app import start_in_thread
from common.engine.metrics import EngineMetrics
from tests.conftest import ServerProcess, free_port, sample

SECRET = "s3cret-for-tests"
AUTH = {"X-Tandem-Secret": SECRET}
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
}
REQUIRED = [f for f in VALID if f not in ("instance_id", "dp_size", "dp_rank")]
INT_FIELDS = [f for f, v in VALID.items() if isinstance(v, int)]
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
    r = httpx.put(
        bootstrap.url + "/route", content=raw, headers=AUTH | {"content-type": "application/json"}, timeout=10
    )
    assert_error(r, status, param)
    assert rejected(bootstrap, param) == before + 1
    assert httpx.get(bootstrap.url + "/health", timeout=5).status_code == 200


def test_oversize_chunked_registration_is_413(bootstrap):
    before = rejected(bootstrap, "body")
    chunks = (b" " * 8192 for _ in range(10))  # no Content-Length: the limit must hold anyway
    r = httpx.put(bootstrap.url + "/route", content=chunks, headers=AUTH, timeout=10)
    assert_error(r, 413, "body")
    assert rejected(bootstrap, "body") == before + 1


def test_compressed_registration_is_415(bootstrap):
    before = rejected(bootstrap, "content-encoding")
    r = httpx.put(
        bootstrap.url + "/route",
        content=gzip.compress(json.dumps(VALID).encode()),
        headers=AUTH | {"content-type": "application/json", "content-encoding": "gzip"},
        timeout=10,
    )
    assert_error(r, 415, "content-encoding")
    assert rejected(bootstrap, "content-encoding") == before + 1


@pytest.mark.parametrize(
    "headers,body",
    [
        pytest.param({}, VALID, id="no-secret"),
        pytest.param({"X-Tandem-Secret": "wrong"}, VALID, id="wrong-header"),
        pytest.param({}, VALID | {"secret": "wrong"}, id="wrong-in-body"),
        pytest.param({}, VALID | {"secret": 12345}, id="non-string-in-body"),
        pytest.param({}, VALID | {"secret": "\ud800"}, id="lone-surrogate-in-body"),
    ],
)
def test_registration_without_the_secret_is_401(bootstrap, headers, body):
    before = rejected(bootstrap, "secret")
    r = httpx.put(bootstrap.url + "/route", content=json.dumps(body).encode(), headers=headers, timeout=10)
    assert_error(r, 401, "secret")
    assert r.json()["error"]["type"] == "authentication_error"
    assert rejected(bootstrap, "secret") == before + 1


def test_valid_registration_after_bad_ones_is_returned_exactly(bootstrap):
    assert httpx.put(bootstrap.url + "/route", json=VALID | {"secret": SECRET}, timeout=10).json() == {"ok": True}
    r = httpx.get(bootstrap.url + "/route", params={"engine_rank": 1, "target_dp_group": 0}, headers=AUTH, timeout=10)
    assert r.status_code == 200
    assert r.json() == VALID
    layout = httpx.get(
        bootstrap.url + "/route", params={"engine_rank": -1, "target_dp_group": -1}, headers=AUTH, timeout=10
    )
    assert layout.json() == {
        k: VALID[k]
        for k in ("tp_size", "dp_size", "page_size", "num_layers", "kv_heads", "head_dim", "dtype", "transfer_backend")
    }
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
    r = httpx.request(method, f"{bootstrap.url}/route?{query}", headers=AUTH, timeout=10)
    assert_error(r, 400, param)
    assert rejected(bootstrap, param, method) == before + 1


def test_lookup_with_a_wrong_secret_is_401_and_counted(bootstrap):
    before = rejected(bootstrap, "secret", "GET")
    r = httpx.get(bootstrap.url + "/route", params={"engine_rank": 1}, headers={"X-Tandem-Secret": "wrong"}, timeout=10)
    assert_error(r, 401, "secret")
    assert rejected(bootstrap, "secret", "GET") == before + 1


def test_unknown_path_and_method_are_json_errors(bootstrap):
    assert_error(httpx.get(bootstrap.url + "/nope", timeout=10), 404, "path")
    assert_error(httpx.post(bootstrap.url + "/route", json=VALID, headers=AUTH, timeout=10), 405, "method")


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

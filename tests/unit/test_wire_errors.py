"""A request the engine failed leaves with the error type its status says: client errors are never typed
as internal, a failed or late PD peer reads as upstream / timeout."""

from __future__ import annotations

import pytest

from common.core.request import FinishReason
from common.http.serving import raise_if_failed
from common.wire.errors import TandemError, error_for_status


@pytest.mark.parametrize(
    "status,type_",
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (409, "conflict_error"),
        (422, "invalid_request_error"),
        (499, "aborted"),
        (500, "internal_error"),
        (502, "upstream_error"),
        (503, "unavailable_error"),
        (504, "timeout_error"),
        (507, "internal_error"),
    ],
)
def test_a_failed_requests_status_picks_its_error_type(status, type_):
    e = error_for_status("why", status)
    assert e.to_dict() == {"error": {"message": "why", "type": type_, "code": status, "param": None}}
    assert e.status == status


def test_an_unavailable_server_says_when_to_retry():
    assert error_for_status("KV cache exhausted", 503).headers == {"Retry-After": "1"}


def test_raise_if_failed_types_an_abort_by_its_status_and_passes_other_finishes():
    with pytest.raises(TandemError) as e:
        raise_if_failed(FinishReason("abort", message="could not reserve memory", status=504))
    assert (e.value.status, e.value.type, str(e.value)) == (504, "timeout_error", "could not reserve memory")
    with pytest.raises(TandemError) as e:
        raise_if_failed(FinishReason("abort"))
    assert (e.value.status, e.value.type, str(e.value)) == (500, "internal_error", "request aborted")
    raise_if_failed(FinishReason("stop", matched=2))
    raise_if_failed(None)

"""Errors are values with a cause; the HTTP edge turns each into one JSON error response.

Body shape (OpenAI-compatible): {"error": {"message": str, "type": str, "code": int, "param": str | None}}
"""

from __future__ import annotations


class TandemError(Exception):
    """An error that ends one request. `status` is the HTTP status the client sees; a subclass names its
    status, type and (one the client may retry soon) `retry_after` seconds in its class line."""

    status: int = 500
    type: str = "internal_error"
    headers: dict[str, str] = {}

    def __init_subclass__(cls, status: int = 500, type: str = "internal_error", retry_after: str | None = None):
        super().__init_subclass__()
        cls.status, cls.type = status, type
        cls.headers = {"Retry-After": retry_after} if retry_after else {}

    def __init__(self, message: str, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status

    def to_dict(self) -> dict:
        return error_body(self.message, self.type, self.status, self.param)


class InvalidRequest(TandemError, status=400, type="invalid_request_error"): ...


class NotFound(TandemError, status=404, type="not_found_error"): ...


class PayloadTooLarge(TandemError, status=413, type="invalid_request_error"): ...


class BodyTimeout(TandemError, status=408, type="invalid_request_error"): ...


class UnsupportedEncoding(TandemError, status=415, type="invalid_request_error"): ...


class Overloaded(TandemError, status=503, type="overloaded_error", retry_after="1"): ...


class RequestAborted(TandemError, status=499, type="aborted"): ...


class Conflict(TandemError, status=409, type="conflict_error"): ...


class Unavailable(TandemError, status=503, type="unavailable_error", retry_after="1"):
    """The server cannot serve this request now (memory exhausted, shutting down); another may."""


class UpstreamFailed(TandemError, status=502, type="upstream_error"):
    """The PD peer (or the KV it sent) failed this request."""


class UpstreamTimeout(TandemError, status=504, type="timeout_error"):
    """The PD peer did not do its part in time."""


BY_STATUS: dict[int, type[TandemError]] = {
    400: InvalidRequest,
    404: NotFound,
    408: BodyTimeout,
    409: Conflict,
    413: PayloadTooLarge,
    499: RequestAborted,
    502: UpstreamFailed,
    503: Unavailable,
    504: UpstreamTimeout,
}


def error_for_status(message: str, status: int) -> TandemError:
    """The error a request that failed with `status` ends with: typed by its status (another 4xx is an
    invalid request, another 5xx an internal error)."""
    cls = BY_STATUS.get(status, InvalidRequest if 400 <= status < 500 else TandemError)
    return cls(message, status=status)


def error_body(message: str, type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}

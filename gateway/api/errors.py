"""Errors the gateway returns, all in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

_log = logging.getLogger("flying.gateway")


class APIError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After (seconds) when set

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.status == 408:  # the rest of the body may still arrive: the connection cannot carry another
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}" + (f" (param {self.param})" if self.param else "")


class InvalidRequest(APIError):
    code = "invalid_request"


class ContextTooLong(APIError):
    code = "context_length_exceeded"


class ModelNotFound(APIError):
    status = 404
    code = "model_not_found"


class NotFound(APIError):
    status = 404
    code = "not_found"


class MethodNotAllowed(APIError):
    status = 405
    code = "method_not_allowed"


class PayloadTooLarge(APIError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(APIError):
    status = 415
    code = "unsupported_media_type"


class QueueFullError(APIError):
    """Backpressure: the queue is full for this priority, or the wait it predicts is too long."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retry_after_s = 1


class NoLiveWorkers(APIError):
    status = 503
    type = "service_unavailable"
    code = "no_live_workers"
    retry_after_s = 2


class NoRouter(APIError):
    status = 503
    type = "service_unavailable"
    code = "no_router"
    retry_after_s = 2


class Draining(APIError):
    status = 503
    type = "service_unavailable"
    code = "draining"
    retry_after_s = 1


# refused at the door, before a request is read whole (gateway.http.connections)
class HeadersTooLarge(APIError):
    status = 431
    code = "request_header_fields_too_large"


class URITooLong(APIError):
    status = 414
    code = "uri_too_long"


class RequestTimeout(APIError):
    status = 408
    code = "request_timeout"


class TooManyConnections(APIError):
    status = 503
    type = "server_error"
    code = "too_many_connections"


class QueueUnavailable(APIError):
    status = 503
    type = "service_unavailable"
    code = "queue_unavailable"
    retry_after_s = 2


class PoisonRequest(APIError):
    """The request crashed its engine (the engine's crash report names it alone in its crashing batch), or was
    running on two engines that died: it is not tried again."""

    status = 500
    type = "server_error"
    code = "request_crashed_engines"


class WorkerFailed(APIError):
    status = 502
    type = "server_error"
    code = "worker_failed"


class QueueTimeout(APIError):
    status = 504
    type = "timeout_error"
    code = "queue_timeout"


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return NotFound(f"no route {request.method} {request.url.path}").response()
    if exc.status_code == 405:
        return MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}").response()
    return InvalidRequest(str(exc.detail)).response()


async def redis_error(request: Request, exc: Exception) -> Response:
    _log.error("redis unavailable: %r", exc)
    return QueueUnavailable("the request queue (Redis) is unavailable; retry later").response()


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug, not a client error; still OpenAI-shaped so clients can parse it."""
    _log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    err = APIError(f"internal error: {type(exc).__name__}", code="internal_error")
    err.status, err.type = 500, "server_error"
    return err.response()

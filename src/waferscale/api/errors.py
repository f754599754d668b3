"""Error shapes. /v1/completions: 422 as FastAPI's HTTPValidationError, everything else as its contract's
ErrorChunkResponse. /v1/chat/completions: the hosted service's flat ErrorResponse {message, type, param, code} for
every error, validation failures included (400 wrong_api_format). Type names are the hosted service's."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from waferscale.engine.errors import ErrorKind, RequestError

log = logging.getLogger("waferscale.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "payment_required_error",
    403: "permission_denied_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "too_many_requests_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
FLAT_PATHS = ("/v1/chat/completions",)  # operations whose contract answers errors as a flat ErrorResponse


class APIError(Exception):
    """An error a client caused or should know about; rendered as an ErrorChunkResponse."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status_code, self.message, param=self.param, code=self.code)


def error_body(status_code: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {
        "status_code": status_code,
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "internal_server_error"),
            "param": param or "",  # the contract's ErrorChunkContent defaults: "" for what is unknown
            "code": code or "",
            "id": "",
        },
    }


# The one place an engine error kind becomes an HTTP status (and an error code the client can branch on).
_KIND_STATUS = {
    ErrorKind.INVALID_REQUEST: (400, None),
    ErrorKind.OVERLOADED: (503, "overloaded"),
    ErrorKind.SHUTTING_DOWN: (503, "shutting_down"),
    ErrorKind.UNAVAILABLE: (503, "engine_unavailable"),
    ErrorKind.INTERNAL: (500, None),
}


def engine_error(err: RequestError) -> APIError:
    """The APIError for an engine's error: status and code from its kind, its message and param as they are."""
    status, code = _KIND_STATUS.get(err.kind, (500, None))
    return APIError(status, err.message, param=err.param, code=code)


def flat_error_body(
    status_code: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict:
    """The chat contract's ErrorResponse: the hosted service's flat shape, not a wrapper."""
    return {
        "message": message,
        "type": _TYPES.get(status_code, "internal_server_error"),
        "param": param,
        "code": code,
    }


def error_response(
    err: APIError, headers: dict[str, str] | None = None, request: Request | None = None
) -> JSONResponse:
    if request is not None and request.url.path in FLAT_PATHS:
        body = flat_error_body(err.status_code, err.message, param=err.param, code=err.code)
    else:
        body = err.body()
    return JSONResponse(body, status_code=err.status_code, headers=headers)


def _is_flat(request: Request) -> bool:
    return request.url.path in FLAT_PATHS


def validation_detail(errors) -> list[dict]:
    """Only loc, msg and type: the spec's ValidationError fields (no echo of the input)."""
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, exc.headers, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        if _is_flat(request):  # a header FastAPI validated, e.g.; the chat contract answers 400 flat
            lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
            body = flat_error_body(400, "\n".join(lines), param="validation_error", code="wrong_api_format")
            return JSONResponse(body, status_code=400)
        return JSONResponse({"detail": validation_detail(exc.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        build = flat_error_body if _is_flat(request) else error_body
        return JSONResponse(build(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        # the client closed its connection before its body was read: nothing to answer, nothing to log loudly
        log.info("%s %s: the client went away before its request was read", request.method, request.url.path)
        return Response(status_code=499)  # nginx's "client closed request"; never delivered

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        build = flat_error_body if _is_flat(request) else error_body
        return JSONResponse(build(500, "internal server error"), status_code=500)

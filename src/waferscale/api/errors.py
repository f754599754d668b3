"""Error shapes: 422 as FastAPI's HTTPValidationError, everything else as the spec's ErrorChunkResponse."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from waferscale.engine.errors import ErrorKind, RequestError

log = logging.getLogger("waferscale.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


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
            "type": _TYPES.get(status_code, "server_error"),
            "param": param,
            "code": code,
            "id": None,
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


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def validation_detail(errors) -> list[dict]:
    """Only loc, msg and type: the spec's ValidationError fields (no echo of the input)."""
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return JSONResponse({"detail": validation_detail(exc.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return JSONResponse(
            error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

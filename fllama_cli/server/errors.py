"""OpenAI's error object for every failure, and the status each kind of failure gets: 400 for the request's own
fault, 401 for a missing or wrong key, 429 / 503 with Retry-After for overload, 500 for the server's fault (the
server itself never stops for one request)."""

from __future__ import annotations

import logging
import math
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fllama_cli.server.schemas import BadRequest
from model_zoo.errors import FllamaError
from model_zoo.ticket import Overloaded, Unavailable

log = logging.getLogger("fllama.serve")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def as_api_error(e: BaseException) -> ApiError:
    """The status and message a library exception gets."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, BadRequest):
        return ApiError(400, str(e), e.param, e.code)
    if isinstance(e, Overloaded):
        return ApiError(429, str(e), code="server_overloaded", retry_after=e.retry_after)
    if isinstance(e, Unavailable):
        return ApiError(503, str(e), code="server_unavailable", retry_after=5.0)
    if isinstance(e, FllamaError):  # PromptError, ConfigError: what the request asked cannot be done
        return ApiError(400, str(e))
    log.error("request failed: %s: %s", type(e).__name__, e, exc_info=e)
    return ApiError(500, f"the server failed on this request ({type(e).__name__}: {e})")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}{more}", param


def install_handlers(app: FastAPI, on_reject: Callable[[int], None]) -> None:
    """Every error becomes OpenAI's object; on_reject(status) counts it (the metrics)."""
    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        on_reject(400)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        on_reject(exc.status_code)
        return error_response(exc.status_code, str(exc.detail))

    async def _mapped(_request: Request, exc: Exception) -> JSONResponse:
        err = as_api_error(exc)
        on_reject(err.status)
        return error_response(err.status, err.message, err.param, err.code, err.retry_after)

    # the request's own errors (and overload) are answered here; anything else reaches the server error handler,
    # which answers the same way and logs the traceback
    for kind in (ApiError, BadRequest, FllamaError, Exception):
        app.add_exception_handler(kind, _mapped)

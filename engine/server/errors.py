"""OpenAI-style errors (the body is contract/errors.py's) for every failure.

`APIError` is raised by handlers; `engine_error` turns the engine's typed errors (engine/errors.py) into
one through the table below; the exception handlers installed by `install_error_handlers` turn it,
FastAPI's request validation errors (its default is a 422 with a different shape), Starlette's 404/405
and anything unexpected into that body. Unexpected exceptions are logged and answered with a 500 in the
same shape; handlers are written so that bad input never gets there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from contract.errors import error_body, error_type
from engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    PinLimitError,
    QueueFullError,
    RequestOutOfMemoryError,
)

logger = logging.getLogger("kvfleet.server")

logger = logging.getLogger("kvfleet.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type(status), param, code), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# engine error -> (HTTP status, OpenAI code, headers); the first matching row wins
ENGINE_ERRORS: tuple[tuple[type[BaseException], int, str | None, dict[str, str] | None], ...] = (
    (InvalidRequestError, 400, None, None),  # code: the error's own (invalid_value, context_length_exceeded)
    (QueueFullError, 429, "engine_overloaded", {"Retry-After": "1"}),
    (PinLimitError, 429, "cache_pin_limit_exceeded", None),
    (EngineDeadError, 503, "engine_dead", None),
    (RequestOutOfMemoryError, 500, "out_of_memory", None),
)


def engine_error(e: BaseException, params: Mapping[str, str] | None = None) -> APIError:
    """The HTTP error for an exception out of the engine. params: engine field -> wire field
    ("prompt" -> "messages" for chat, "max_tokens" -> "max_completion_tokens" where that was sent)."""
    for kind, status, code, headers in ENGINE_ERRORS:
        if isinstance(e, kind):
            if isinstance(e, InvalidRequestError):
                return APIError(status, str(e), (params or {}).get(e.param, e.param), e.code, headers)
            return APIError(status, str(e), None, code, headers)
    logger.error("engine error", exc_info=e)
    return APIError(500, f"internal engine error: {type(e).__name__}", None, "internal_error")


_SCALAR_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _is_branch_tag(part) -> bool:
    """pydantic names union branches in error locations: 'str', 'list[int]', 'function-after[..]', 'TextPart'."""
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or "-" in part or part[:1].isupper())


def format_loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union branch names are dropped."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if _is_branch_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _param(errors: list[dict]) -> str | None:
    """The field to blame: the common path of all errors (a union reports one error per branch)."""
    locs = [tuple(p for p in e.get("loc", ()) if p != "body") for e in errors]
    common: list = []
    for parts in zip(*locs, strict=False):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    if not common:
        return format_loc(locs[0])
    if len(locs) > 1:  # cut at the first union branch: the field itself is what was wrong
        for i, part in enumerate(common):
            if _is_branch_tag(part):
                common = common[:i]
                break
    return format_loc(tuple(common))


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable message (and the offending field) from pydantic's error list."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    param = _param(errors)
    if first.get("type") in ("missing", "model_attributes_type", "dict_type") and format_loc(first.get("loc", ())) is None:
        return "request body must be a JSON object", None
    msgs = []
    for e in errors[:3]:
        where = format_loc(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        line = f"{where}: {msg}" if where else msg
        if line not in msgs:
            msgs.append(line)
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    return "; ".join(msgs) + more, param


def _count_rejected(request: Request, status: int) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None and request.url.path.startswith("/v1/"):
        metrics.rejected.labels(metrics.model_name, str(status)).inc()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count_rejected(request, exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count_rejected(request, 400)
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such endpoint"
        return error_response(exc.status_code, message, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")

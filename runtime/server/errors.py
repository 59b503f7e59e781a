"""Exceptions → HTTP answers, in one table. Every error is JSON ``{"error": {...}}``.

    InvalidRequestError, PromptTooLongError, ConstraintError  → 400
    pydantic / FastAPI validation (wrong types, malformed JSON) → 422 (400 for bad JSON
                                                         and for unknown fields)
    ProgramNotFoundError, ModelNotFoundError,
    SessionNotFoundError (DELETE /sessions/{id})              → 404
    ProgramLimitExceededError (a run past its bounds)         → 422
    GenerationFailedError, ProgramRunFailedError              → 500
    Overloaded                                                → 429 / 503
    EngineClosedError                                         → 503
    RequestTimeoutError                                       → 504
    ClientGoneError                                           → 499 (nobody reads it)
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request

from grammars import ConstraintError
from runtime.errors import (
    EngineClosedError,
    EngineFailedError,
    InvalidRequestError,
    PromptTooLongError,
)
from runtime.output.request_output import GRAMMAR_ERROR, RequestOutput
from runtime.server.api.common.fields import unknown_message
from runtime.server.hosting import ProgramLimitExceededError, ProgramRunFailedError
from runtime.server.limits import Overloaded, error_body
from runtime.server.serving import (
    ClientGoneError,
    ModelNotFoundError,
    RequestTimeoutError,
    ServerContext,
)

log = logging.getLogger("arbor.server")


class ProgramNotFoundError(LookupError):
    """No program of that name was registered when the server started."""


class SessionNotFoundError(LookupError):
    """No live retention session of that id for the caller's tenant (HTTP 404)."""


class GenerationFailedError(Exception):
    """The engine finished the request with an error (``RequestOutput.error``)."""


def raise_if_failed(ctx: ServerContext, out: RequestOutput) -> None:
    """An engine output that failed, as an exception: 503 when the server is shutting down
    (the engine was closed under the request at the shutdown deadline) or the engine can
    no longer serve (``Engine.failure``: a tensor-parallel rank died), 400 when the
    request's own grammar failed while generating, else 500."""
    if out.error is None:
        return
    if ctx.gate.closing:
        raise EngineClosedError(f"the server is shutting down: {out.error}")
    if getattr(ctx.engine, "failure", None) is not None:
        raise EngineFailedError(out.error)
    if out.error.startswith(GRAMMAR_ERROR):
        raise ConstraintError(f"the constraint failed while generating: {out.error.removeprefix(GRAMMAR_ERROR)}")
    raise GenerationFailedError(f"generation failed: {out.error}")


def classify(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, error kind) of an exception raised while serving a request."""
    for cls, status, kind in _table():
        if isinstance(exc, cls):
            if isinstance(exc, Overloaded):
                return exc.status, "rate_limit_error" if exc.status == 429 else "service_unavailable"
            return status, kind
    return 500, "internal_error"


def _table() -> list[tuple[type[Exception], int, str]]:
    return [
        (Overloaded, 429, "rate_limit_error"),
        (PromptTooLongError, 400, "context_length_exceeded"),
        (InvalidRequestError, 400, "invalid_request_error"),
        (ConstraintError, 400, "invalid_constraint"),
        (ProgramNotFoundError, 404, "not_found_error"),
        (SessionNotFoundError, 404, "not_found_error"),
        (ProgramLimitExceededError, 422, "program_limit"),
        (ModelNotFoundError, 404, "model_not_found"),
        (EngineClosedError, 503, "service_unavailable"),
        (RequestTimeoutError, 504, "timeout"),
        (ClientGoneError, 499, "client_closed_request"),
        (GenerationFailedError, 500, "generation_failed"),
        (ProgramRunFailedError, 500, "program_failed"),
    ]


def install_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    """Register the table above on ``app``; every error is also counted by kind."""

    def answer(status: int, kind: str, message: str,
               headers: dict[str, str] | None = None) -> JSONResponse:
        ctx.metrics.errors.labels(kind).inc()
        return JSONResponse(error_body(message, kind, status), status_code=status, headers=headers)

    async def on_known(request: Request, exc: Exception) -> JSONResponse:
        status, kind = classify(exc)
        if status == 500:
            log.exception("request %s failed", request.url.path, exc_info=exc)
        return answer(status, kind, str(exc) or type(exc).__name__, retry_headers(exc))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return answer(400, "invalid_json", f"malformed JSON body: {_describe(errors)}")
        if all(e.get("type") == "extra_forbidden" for e in errors):  # api/common/fields.py: unknown is a 400
            paths = [".".join(str(p) for p in e.get("loc", ()) if p != "body" and not _is_union_tag(p))
                     for e in errors]
            return answer(400, "unknown_field", unknown_message(paths))
        return answer(422, "validation_error", _describe(errors))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return answer(exc.status_code, "http_error", str(exc.detail))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    for cls, _, _ in _table():
        app.add_exception_handler(cls, on_known)


def retry_headers(exc: BaseException) -> dict[str, str] | None:
    """``Retry-After`` (whole seconds, at least 1) for a refusal that says when to retry."""
    if isinstance(exc, Overloaded) and exc.retry_after is not None:
        return {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    return None


_PLAIN_TYPES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_union_tag(part: Any) -> bool:
    """A ``loc`` part naming the member of a union tried (``list[int]``, ``SglSamplingParams``),
    not a field: left out of the path a client reads."""
    return isinstance(part, str) and ("[" in part or part[:1].isupper() or part in _PLAIN_TYPES)


def _describe(errors: Any) -> str:
    """``loc: msg`` for each pydantic error, joined."""
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body" and not _is_union_tag(p))
        parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def stream_error_event(exc: BaseException, ctx: ServerContext) -> dict[str, Any]:
    """The SSE payload sent when a stream fails after its first byte."""
    status, kind = classify(exc)
    ctx.metrics.errors.labels(kind).inc()
    if status == 500:
        log.error("stream failed: %r", exc)
    return error_body(str(exc) or type(exc).__name__, kind, status)

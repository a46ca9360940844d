"""Errors as the server answers them: Ollama's routes with {"error": "..."}, the /v1 routes in OpenAI's
shape, {"error": {"message", "type", ...}}; each kind of failure with its status, a bug with a 500 that
carries an id the log has the details under."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyplugin.serving import (ChatTemplateError, InvalidModelName, ModelLoadError, ModelNotFoundError, OptionsError,
                              PebblingError, PullStopped, RegistryError, ServerBusyError, StoreError,
                              StoreWriteError, StrategyError)

from .streaming import BadRequest


class PushRefused(Exception):
    """/api/push: pebbling does not publish models (HTTP 501)."""

logger = logging.getLogger("pebbling.server")


def status_for(exc: Exception) -> int:
    if isinstance(exc, PushRefused):
        return 501
    if isinstance(exc, ModelNotFoundError) or (isinstance(exc, PebblingError) and isinstance(exc, LookupError)):
        return 404  # a model, blob or registry entry that does not exist
    if isinstance(exc, RegistryError):
        return 502
    if isinstance(exc, StoreWriteError):
        return 507      # the disk refused the write: full, read-only
    if isinstance(exc, PullStopped):
        return 504      # its deadline passed (or its client left, and reads nothing)
    if isinstance(exc, (InvalidModelName, OptionsError, StrategyError, ChatTemplateError, BadRequest,
                        ModelLoadError, StoreError)):
        return 400
    if isinstance(exc, ServerBusyError):
        return 503
    return 500      # a store failure, a device out of memory: the message says which


def error_response(path: str, status: int, message: str, code: str | None = None) -> JSONResponse:
    """The error as the route's clients read it; `code`: OpenAI's code, for the /v1 routes."""
    if path.startswith("/v1/"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, 400, describe_validation_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such endpoint"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
        return error_response(request.url.path, exc.status_code, message)

    async def known_error(request: Request, exc: Exception) -> JSONResponse:
        status = status_for(exc)
        if status >= 500 and status not in (501, 503):
            logger.error("request %s: %s %s: %s", request_id(), request.method, request.url.path, exc)
        code = "model_not_found" if isinstance(exc, ModelNotFoundError) else None
        return error_response(request.url.path, status, str(exc), code)

    for cls in (PebblingError, BadRequest, PushRefused):
        app.add_exception_handler(cls, known_error)

    app.add_middleware(UnexpectedErrors)  # the innermost middleware: the others see its 500 as any answer


def unexpected_response(method: str, path: str, exc: Exception) -> JSONResponse:
    """A bug, not a bad request: the client gets JSON and an id to quote, the log the traceback."""
    rid = request_id()
    logger.error("request %s: %s %s failed", rid, method, path, exc_info=exc)
    return error_response(path, 500, f"internal error ({type(exc).__name__}); the server log has the details "
                                     f"under request {rid}")


class UnexpectedErrors:
    """Answers an exception no handler took with a JSON 500, and keeps the connection. (Starlette's
    handler for Exception answers too, but then raises again, and the server closes the kept-alive
    connection under the client, whose next request on it fails.) Once a response has begun, the
    exception goes on: the connection must close, since the answer cannot be completed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            await unexpected_response(scope.get("method", ""), scope.get("path", ""), exc)(scope, receive, send)


def request_id() -> str:
    return secrets.token_hex(6)


def describe_validation_errors(errors: list[dict[str, Any]]) -> str:
    """One line a person can act on, from pydantic's error list (the first problem of each field)."""
    seen, parts = set(), []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            where = f" at character {loc[0]}" if loc else ""
            problem = err.get("ctx", {}).get("error", err.get("msg"))
            return f"invalid JSON in the request body{where}: {problem}"
        if not loc:
            if kind == "missing":
                return 'the request body is empty: send a JSON object such as {"model": "pebbling-demo"}'
            return f"the request body must be a JSON object, got {_json_type(err.get('input'))}"
        field = ".".join(loc)
        if field in seen:
            continue
        seen.add(field)
        if kind == "missing":
            parts.append(f"'{field}' is required")
        else:
            parts.append(f"'{field}': {err.get('msg')}, got {json.dumps(err.get('input'), default=str)[:80]}")
    return "invalid request: " + "; ".join(parts)


def _json_type(value: Any) -> str:
    for t, name in ((bool, "a boolean"), (str, "a string"), (list, "an array"), ((int, float), "a number")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__

"""The Ollama-compatible HTTP API, with the OpenAI-compatible endpoints beside it.

Ollama's routes answer errors as 400/404/413/500 with {"error": "..."}; the /v1 routes answer them
in OpenAI's shape, {"error": {"message", "type", ...}}, which OpenAI clients know how to read.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyplugin.serving import (ChatTemplateError, Engine, Final, GenerationRequest, InvalidModelName, ModelListing,
                              ModelLoadError, ModelNotFoundError, OptionsError, Output, PebblingError,
                              ServerBusyError, StrategyError)

from . import openai_compat, openapi
from .guard import RequestGuard
from .metrics import Metrics, RequestMetrics
from .replies import chat_message
from .streaming import (BadRequest, collect, collect_output, dumps, engine_of, iso, logprobs_wanted, now_iso,
                        ollama_logprobs, outputs,
                        refuse_unsupported, submit)
from .schemas import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, ShowRequest

MAX_BODY_BYTES = 8 << 20  # 8 MiB: far beyond any prompt num_ctx allows, small enough to buffer
NDJSON = "application/x-ndjson"
logger = logging.getLogger("pebbling.server")

try:
    VERSION = version("pebbling")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0.0.0"


def create_app(engine: Engine | None = None, *, models_dir: str | Path | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app. Without `engine`, one is made for `models_dir` and closed at shutdown."""
    owned = engine is None
    engine = engine or Engine(models_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owned:
            engine.close()

    app = FastAPI(title="pebbling", version=VERSION, lifespan=lifespan,
                  description="Ollama- and OpenAI-compatible API of pebbling, which runs GGUF models "
                              "in any GPU memory budget by streaming layer state.")
    app.state.engine = engine
    app.state.metrics = metrics = Metrics(engine)
    engine.on_final(metrics.finished)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestGuard)
    app.add_middleware(RequestMetrics, metrics=metrics)  # added last: it runs first, and counts the rest
    _add_error_handlers(app)
    app.include_router(_ollama_routes())
    app.include_router(openai_compat.router)
    openapi.install(app)
    metrics.routes = app.routes
    return app


# ---------------------------------------------------------------------------------------------------
# errors


def status_for(exc: Exception) -> int:
    if isinstance(exc, ModelNotFoundError):
        return 404
    if isinstance(exc, (InvalidModelName, OptionsError, StrategyError, ChatTemplateError, BadRequest,
                        ModelLoadError)):
        return 400
    if isinstance(exc, ServerBusyError):
        return 503
    return 500      # a store failure, a device out of memory: the message says which


def error_response(path: str, status: int, message: str) -> JSONResponse:
    if path.startswith("/v1/"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": None,
                                          "code": "model_not_found" if status == 404 else None}}
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
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
        if status >= 500 and status != 503:
            logger.error("request %s: %s %s: %s", request_id(), request.method, request.url.path, exc)
        return error_response(request.url.path, status, str(exc))

    for cls in (PebblingError, BadRequest):
        app.add_exception_handler(cls, known_error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a bad request: the client gets JSON and an id to quote, the log the traceback.
        rid = request_id()
        logger.error("request %s: %s %s failed", rid, request.method, request.url.path, exc_info=exc)
        return error_response(request.url.path, 500, f"internal error ({type(exc).__name__}); the server log "
                                                     f"has the details under request {rid}")


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


# ---------------------------------------------------------------------------------------------------
# request bodies: a size limit, and JSON whatever the Content-Type


class BodyLimit:
    """Buffers each request body up to `max_bytes` (413 beyond it) and marks POST bodies as JSON.

    Ollama reads every body as JSON, and `curl -d` sends application/x-www-form-urlencoded, which
    FastAPI would not parse; so POST bodies are declared JSON here.
    """

    _DRAIN_LIMIT = 64 << 20  # read (and drop) at most this much of an oversized body before answering

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"0")
        too_large = not declared.isdigit() or int(declared) > self.max_bytes
        body, received, more = bytearray(), 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            more = message.get("more_body", False)
            if received > self.max_bytes:
                too_large = True
            if too_large:
                # Reading the rest lets the client see the 413 instead of a reset connection.
                if received > self._DRAIN_LIMIT:
                    break
                continue
            body += chunk
        if too_large:
            limit = f"{self.max_bytes} bytes ({self.max_bytes / 2**20:g} MiB)"
            response = error_response(scope["path"], 413, f"the request body is larger than the limit "
                                                          f"of {limit}; send a shorter prompt")
            return await response(scope, receive, send)

        if json_too_deep(bytes(body)):
            return await error_response(scope["path"], 400, f"the request body's JSON nests arrays and objects "
                                                            f"more than {MAX_JSON_DEPTH} deep; send at most "
                                                            f"{MAX_JSON_DEPTH} levels")(scope, receive, send)
        if _SURROGATE_ESCAPE.search(body):
            body = _without_lone_surrogates(bytes(body))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, for handlers that watch it

        if scope["method"] == "POST":
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        await self.app(scope, replay, send)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# An escaped backslash, a valid surrogate pair, or a lone surrogate: matched left to right, so the escape
# after an escaped backslash ("\\\\ud800" is a backslash and the text "ud800") is never taken for one.
_ESCAPE_OR_SURROGATE = re.compile(rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                                  rb"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _without_lone_surrogates(body: bytes) -> bytes:
    """The body with each lone UTF-16 surrogate escape (\\ud800 without its pair) read as U+FFFD, as
    Go's JSON decoder (and so Ollama) reads it: Python would keep it, and no text can be encoded with
    one in it. Rewritten in the text itself, so no nesting depth can make it recurse."""
    return _ESCAPE_OR_SURROGATE.sub(lambda m: m[0] if len(m[0]) in (2, 12) else rb"\ufffd", body)


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
MAX_JSON_DEPTH = 256  # arrays and objects in a request body: far past any schema, tool or message list


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays and objects more than `limit` deep (brackets inside strings are
    not counted). Counted with numpy over the bytes, so an 8 MiB body costs milliseconds."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    structure = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    steps = np.zeros(structure.shape, dtype=np.int32)
    steps[(structure == ord("[")) | (structure == ord("{"))] = 1
    steps[(structure == ord("]")) | (structure == ord("}"))] = -1
    return bool(steps.size) and int(np.cumsum(steps).max()) > limit


# ---------------------------------------------------------------------------------------------------
# Ollama's routes


def _ollama_routes() -> APIRouter:
    router = APIRouter()

    @router.head("/", response_class=PlainTextResponse, include_in_schema=False)
    @router.get("/", response_class=PlainTextResponse, tags=["ollama"])
    async def root() -> str:
        return "pebbling is running"

    @router.get("/metrics", tags=["pebbling"], response_class=PlainTextResponse,
                summary="Prometheus metrics: requests, tokens, bytes restored, peak device memory, queue depth")
    async def metrics(request: Request) -> Response:
        return request.app.state.metrics.response()

    @router.get("/api/version", tags=["ollama"])
    async def api_version() -> dict:
        return {"version": VERSION}

    @router.post("/api/generate", tags=["ollama"])
    async def generate(body: GenerateRequest, request: Request) -> Response:
        refuse_unsupported(body)
        if body.images:
            raise BadRequest("'images' is not supported: pebbling serves text-only models")
        if body.suffix:
            raise BadRequest("'suffix' (fill-in-the-middle) is not supported by pebbling")
        job = await submit(request, GenerationRequest(
            model=body.model, prompt=body.prompt, system=body.system, template=body.template, raw=body.raw,
            context=body.context, format=body.format, options=body.options or {}, keep_alive=body.keep_alive,
            think=body.think, logprobs=logprobs_wanted(body.logprobs, body.top_logprobs)))

        def chunk(out: Output) -> dict:
            thinking = {"thinking": out.thinking} if out.thinking else {}
            return {"model": body.model, "created_at": now_iso(), "response": out.content, **thinking, "done": False,
                    **ollama_logprobs(out.logprobs)}

        def final(out: Output, f: Final) -> dict:
            return {**chunk(out), "done": True, "done_reason": f.done_reason, "context": f.context,
                    **f.stats(), "pebbling": f.report, **ollama_logprobs(None if body.stream else f.logprobs)}

        if body.stream:
            return _ndjson(job, chunk, final)
        out, f = await collect_output(job, request)
        return JSONResponse(final(out, f)) if f else Response(status_code=499)

    @router.post("/api/chat", tags=["ollama"])
    async def chat(body: ChatRequest, request: Request) -> Response:
        refuse_unsupported(body)
        if any(m.images for m in body.messages):
            raise BadRequest("'images' is not supported: pebbling serves text-only models")
        job = await submit(request, GenerationRequest(
            model=body.model, messages=[chat_message(m, i) for i, m in enumerate(body.messages)],
            format=body.format, options=body.options or {}, keep_alive=body.keep_alive, tools=body.tools or None,
            think=body.think, logprobs=logprobs_wanted(body.logprobs, body.top_logprobs)))

        def chunk(out: Output) -> dict:
            message = {"role": "assistant", "content": out.content}
            if out.thinking:
                message["thinking"] = out.thinking
            if out.tool_calls:
                message["tool_calls"] = [{"function": {"index": i, "name": c.name, "arguments": c.arguments}}
                                         for i, c in enumerate(out.tool_calls, start=calls[0])]
                calls[0] += len(out.tool_calls)
            return {"model": body.model, "created_at": now_iso(), "message": message, "done": False,
                    **ollama_logprobs(out.logprobs)}

        def final(out: Output, f: Final) -> dict:
            return {**chunk(out), "done": True, "done_reason": f.done_reason, **f.stats(),
                    "pebbling": f.report, **ollama_logprobs(None if body.stream else f.logprobs)}

        calls = [0]  # calls sent so far: each carries its index, as Ollama's do
        if body.stream:
            return _ndjson(job, chunk, final)
        out, f = await collect_output(job, request)
        return JSONResponse(final(out, f)) if f else Response(status_code=499)

    @router.post("/api/embed", tags=["ollama"])
    async def embed(body: EmbedRequest, request: Request) -> Response:
        texts = [body.input] if isinstance(body.input, str) else body.input
        job = await submit(request, GenerationRequest(model=body.model, embed=texts, truncate=body.truncate,
                                                      dimensions=body.dimensions, options=body.options or {},
                                                      keep_alive=body.keep_alive))
        _, f = await collect(job, request)
        if f is None:
            return Response(status_code=499)
        return JSONResponse({"model": body.model, "embeddings": f.embeddings, "total_duration": f.total_duration,
                             "load_duration": f.load_duration, "prompt_eval_count": f.prompt_eval_count,
                             "pebbling": f.report})

    @router.post("/api/embeddings", tags=["ollama"])
    async def legacy_embeddings(body: EmbeddingsRequest, request: Request) -> Response:
        job = await submit(request, GenerationRequest(model=body.model, embed=[body.prompt] if body.prompt else [],
                                                      normalize=False, options=body.options or {},
                                                      keep_alive=body.keep_alive))
        _, f = await collect(job, request)
        if f is None:
            return Response(status_code=499)
        return JSONResponse({"embedding": f.embeddings[0] if f.embeddings else []})

    @router.get("/api/tags", tags=["ollama"])
    async def tags(request: Request) -> dict:
        listings = await run_in_threadpool(engine_of(request).list_models)
        return {"models": [_tag(m) for m in listings]}

    @router.post("/api/show", tags=["ollama"])
    async def show(body: ShowRequest, request: Request) -> dict:
        name = body.model or body.name
        if not name:
            raise BadRequest("'model' is required")
        listing, extra = await run_in_threadpool(engine_of(request).show, name)
        return {**extra, "details": listing.details, "modified_at": iso(listing.modified)}

    @router.get("/api/ps", tags=["ollama"])
    async def ps(request: Request) -> dict:
        return {"models": [{
            "name": m.name, "model": m.name, "size": m.size, "digest": m.digest, "details": m.details,
            # Ollama shows a model kept forever as expiring in the far future.
            "expires_at": iso(min(m.expires_at, 253402300799.0)), "size_vram": m.size_vram,
        } for m in engine_of(request).running()]}

    return router


def _tag(m: ModelListing) -> dict:
    return {"name": m.name, "model": m.name, "modified_at": iso(m.modified), "size": m.size,
            "digest": m.digest, "details": m.details}


def _ndjson(job, chunk, final) -> StreamingResponse:
    async def lines():
        try:
            async for item in outputs(job):
                if isinstance(item, Final):
                    yield dumps(final(Output(), item)) + "\n"
                else:
                    yield dumps(chunk(item)) + "\n"
        except Exception as exc:  # the status line is sent: Ollama reports the error as a last line
            logger.error("generation failed: %s", exc)
            yield dumps({"error": str(exc)}) + "\n"

    return StreamingResponse(lines(), media_type=NDJSON)

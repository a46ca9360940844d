"""The Ollama-compatible HTTP API, with the OpenAI-compatible endpoints beside it.

Ollama's routes answer errors as 400/404/413/500 with {"error": "..."}; the /v1 routes answer them
in OpenAI's shape, {"error": {"message", "type", ...}}, which OpenAI clients know how to read
(errors.py). Request bodies are limited and read as JSON in bodies.py; model management (create, pull,
copy, delete, blobs) is in model_admin.py.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pyplugin.serving import Engine, Final, GenerationRequest, ModelListing, Output

from . import model_admin, openai_compat, openapi, responses, web
from .bodies import BodyLimit
from .errors import add_error_handlers
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
    add_error_handlers(app)  # first: its middleware is the innermost
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestGuard)
    app.add_middleware(RequestMetrics, metrics=metrics)  # added last: it runs first, and counts the rest
    app.include_router(_ollama_routes())
    app.include_router(model_admin.router)
    app.include_router(openai_compat.router)
    app.include_router(responses.router)
    app.include_router(web.router)  # GET /: the page for a browser, plain text for the rest; the estimate
    openapi.install(app)
    metrics.routes = app.routes
    return app


# ---------------------------------------------------------------------------------------------------
# Ollama's routes


def _ollama_routes() -> APIRouter:
    router = APIRouter()

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
        job = await submit(request, GenerationRequest(
            model=body.model, prompt=body.prompt, suffix=body.suffix, system=body.system, template=body.template,
            raw=body.raw,
            context=body.context, format=body.format, options=body.options or {}, keep_alive=body.keep_alive,
            think=body.think, shift=body.shift, logprobs=logprobs_wanted(body.logprobs, body.top_logprobs)))

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
            think=body.think, shift=body.shift, logprobs=logprobs_wanted(body.logprobs, body.top_logprobs)))

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
        # "digest" is pebbling's: the model's ID as /api/tags and /api/ps give it (Ollama's show has none)
        return {**extra, "details": listing.details, "modified_at": iso(listing.modified), "digest": listing.digest}

    @router.get("/api/ps", tags=["ollama"])
    async def ps(request: Request) -> dict:
        return {"models": [{
            "name": m.name, "model": m.name, "size": m.size, "digest": m.digest, "details": m.details,
            # Ollama shows a model kept forever as expiring in the far future.
            "expires_at": iso(min(m.expires_at, 253402300799.0)), "size_vram": m.size_vram,
            "context_length": m.context_length, **({"pebbling": m.placement} if m.placement else {}),
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

"""Ollama's model management: /api/blobs/:digest, /api/create, /api/pull, /api/copy, /api/delete, and
/api/push (refused: pebbling does not publish models). Models are written to Ollama's store, laid out
as Ollama lays it out, so that the two share it.

A blob upload streams to disk as it arrives, hashed on the way (never held in memory, and not bound by
the request-body limit of the JSON routes) and is refused, and removed, when its bytes do not hash to
its digest. Create and pull stream Ollama's progress objects (NDJSON) unless "stream" is false; an error
after the first line is sent is the last line, {"error": ...}, as Ollama sends it.

Model management runs on threads of its own (at most ADMIN_THREADS at once, the rest wait their turn),
never on the pool that listing, showing and generation use: however many pulls hang on a slow registry,
the rest of the server answers. A pull whose client leaves, streamed or not, is stopped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from functools import partial
from typing import Any, Callable, Iterator, TypeVar

import anyio
from anyio.to_thread import run_sync
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field
from starlette.requests import ClientDisconnect

from pyplugin.serving import (BlobWriter, CreateSpec, ModelNotInStore, PebblingError, StoreError, blob_path,
                              copy_model, create_model, delete_model, pull_model)

from .errors import PushRefused
from .schemas import _Body
from .streaming import BadRequest, dumps, engine_of

router = APIRouter(tags=["ollama"])
logger = logging.getLogger("pebbling.server")
NDJSON = "application/x-ndjson"
ADMIN_THREADS = 8
_T = TypeVar("_T")
_limiter: anyio.CapacityLimiter | None = None  # made in the event loop that serves, on first use


async def admin_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)` on one of model management's own threads."""
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(ADMIN_THREADS)
    return await run_sync(partial(fn, *args), limiter=_limiter)


class CreateRequest(_Body):
    model: str = Field(description="the new model's name, e.g. 'mario' or 'me/mario:v1'")
    from_: str | None = Field(None, alias="from", description="an existing model to start from")
    files: dict[str, str] | None = Field(None, description="{filename: digest} of one GGUF uploaded with "
                                                           "POST /api/blobs/:digest")
    adapters: dict[str, str] | None = Field(None, description="not supported: LoRA adapters")
    template: str | None = Field(None, description="a Go template, the model's chat template")
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] | None = Field(None, description="default options, e.g. {\"temperature\": 0.2}")
    messages: list[dict[str, Any]] | None = Field(None, description="turns every chat starts with")
    quantize: str | None = Field(None, description="not supported: create from a quantized GGUF")
    modelfile: str | None = Field(None, description="not taken: older clients' Modelfile text")
    stream: bool = True


class PullRequest(_Body):
    model: str | None = None
    name: str | None = Field(None, description="older clients' spelling of `model`")
    insecure: bool = Field(False, description="http:// for a name that carries its own registry host")
    stream: bool = True


class CopyRequest(_Body):
    source: str
    destination: str


class DeleteRequest(_Body):
    model: str | None = None
    name: str | None = Field(None, description="older clients' spelling of `model`")


def _name(body) -> str:
    name = body.model or body.name
    if not name:
        raise BadRequest("'model' is required")
    return name


# ---------------------------------------------------------------------------------------------------
# blobs


@router.head("/api/blobs/{digest}", summary="whether the server has the blob (200) or not (404)")
async def blob_exists(digest: str) -> Response:
    return Response(status_code=200 if blob_path(digest).is_file() else 404)


@router.post("/api/blobs/{digest}", status_code=201,
             summary="upload a blob (e.g. a GGUF) named by the SHA-256 of its bytes, streamed to disk")
async def blob_upload(digest: str, request: Request) -> Response:
    writer = BlobWriter(digest)  # an invalid digest: refused before a byte is read
    try:
        async for chunk in request.stream():
            if chunk:
                await admin_thread(writer.write, chunk)
    except ClientDisconnect:
        writer.abort()
        return Response(status_code=499)  # nobody reads this: the client is gone
    except BaseException:
        writer.abort()
        raise
    await admin_thread(writer.commit)
    return Response(status_code=201)


# ---------------------------------------------------------------------------------------------------
# create, pull, copy, delete, push


@router.post("/api/create", summary="create a model from an uploaded GGUF or an existing model")
async def create(body: CreateRequest, request: Request) -> Response:
    spec = CreateSpec(model=body.model, from_=body.from_, files=body.files, adapters=body.adapters,
                      template=body.template, license=body.license, system=body.system,
                      parameters=body.parameters, messages=body.messages, quantize=body.quantize,
                      extra={"modelfile": body.modelfile})
    catalogue = engine_of(request).catalogue
    progress = await admin_thread(create_model, spec, catalogue)
    return await _progress(progress, body.stream, request)


@router.post("/api/pull", summary="pull a model from a registry (Ollama's by default; $PEBBLING_REGISTRY)")
async def pull(body: PullRequest, request: Request) -> Response:
    cancel = threading.Event()
    progress = pull_model(_name(body), insecure=body.insecure, cancel=cancel)
    return await _progress(progress, body.stream, request, cancel)


@router.post("/api/copy", summary="give a model a second name")
async def copy(body: CopyRequest, request: Request) -> Response:
    await admin_thread(copy_model, body.source, body.destination, engine_of(request).catalogue)
    return Response(status_code=200)


@router.delete("/api/delete", summary="delete a model from Ollama's store (and the blobs only it used)")
async def delete(body: DeleteRequest, request: Request) -> Response:
    name = _name(body)
    try:
        await admin_thread(delete_model, name)
        engine_of(request).catalogue.drop_stale()  # what the catalogue knew of the model goes with it
    except ModelNotInStore:
        try:
            engine_of(request).find(name)
        except LookupError:
            raise ModelNotInStore(f"model '{name}' not found") from None
        raise StoreError(f"model '{name}' is not in the Ollama store pebbling writes ($OLLAMA_MODELS, else "
                         "~/.ollama/models) but a file of the models directory, the demo, or a model of the Linux "
                         "service's store: pebbling deletes only models of its store; remove the file yourself") \
            from None
    return Response(status_code=200)


@router.post("/api/push", status_code=501, summary="not implemented: pebbling does not publish models")
async def push() -> Response:
    raise PushRefused("/api/push is not implemented: pebbling does not publish models to a registry; push "
                      "with Ollama itself (`ollama push`), which reads the same store")


async def _progress(progress: Iterator[dict[str, Any]], stream: bool, request: Request,
                    cancel: threading.Event | None = None) -> Response:
    """The progress as Ollama sends it. The iterator is always closed at the end (so a transfer cut short
    lets go of what it holds); `cancel` is set when the client leaves."""
    cancel = cancel or threading.Event()
    if not stream:
        return JSONResponse(await _last(progress, request, cancel))

    # The first two objects are taken before the status line goes out (a pull's second comes once the
    # manifest is in), so an error found at once is still an HTTP error; later ones end the stream with
    # an error line, as Ollama ends it.
    first: list[dict[str, Any]] = []
    try:
        for _ in range(2):
            item = await admin_thread(next, progress, None)
            if item is not None:
                first.append(item)
    except BaseException:
        await _close(progress, cancel)
        raise

    async def lines():
        try:
            for item in first:
                yield dumps(item) + "\n"
            while (item := await admin_thread(next, progress, None)) is not None:
                if await request.is_disconnected():
                    break  # the server drops what is sent to a client that left, without a word: stop here
                yield dumps(item) + "\n"
        except Exception as exc:
            if not isinstance(exc, PebblingError):  # a bug: the log has its traceback
                logger.exception("a model transfer failed")
            yield dumps({"error": str(exc)}) + "\n"
        finally:  # also when the client left and the response was cancelled
            await _close(progress, cancel)

    return StreamingResponse(lines(), media_type=NDJSON)


async def _close(progress: Iterator[dict[str, Any]], cancel: threading.Event) -> None:
    cancel.set()
    close = getattr(progress, "close", None)
    if close is not None:
        with anyio.CancelScope(shield=True):
            await admin_thread(close)


async def _last(progress: Iterator[dict[str, Any]], request: Request, cancel: threading.Event) -> dict[str, Any]:
    """The last progress object, taken on an admin thread while the client is watched: if it leaves, the
    transfer is told to stop (it ends at its next bytes, or its registry's timeout)."""
    def drain() -> dict[str, Any]:
        last: dict[str, Any] = {}
        for last in progress:
            pass
        return last

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        cancel.set()

    watcher = asyncio.ensure_future(watch())
    try:
        return await admin_thread(drain)
    finally:
        watcher.cancel()
        await _close(progress, cancel)

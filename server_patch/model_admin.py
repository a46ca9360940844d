"""Ollama's model management: /api/blobs/:digest, /api/create, /api/pull, /api/copy, /api/delete, and
/api/push (refused: pebbling does not publish models). Models are written to Ollama's store, laid out
as Ollama lays it out, so that the two share it.

A blob upload streams to disk as it arrives, hashed on the way (never held in memory, and not bound by
the request-body limit of the JSON routes) and is refused, and removed, when its bytes do not hash to
its digest. Create and pull stream Ollama's progress objects (NDJSON) unless "stream" is false; an error
after the first line is sent is the last line, {"error": ...}, as Ollama sends it.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from pyplugin.serving import (BlobWriter, CreateSpec, ModelNotInStore, PebblingError, StoreError, blob_path,
                              copy_model, create_model, delete_model, pull_model)

from .errors import PushRefused
from .schemas import _Body
from .streaming import BadRequest, dumps, engine_of

router = APIRouter(tags=["ollama"])
logger = logging.getLogger("pebbling.server")
NDJSON = "application/x-ndjson"


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
                await run_in_threadpool(writer.write, chunk)
    except ClientDisconnect:
        writer.abort()
        return Response(status_code=499)  # nobody reads this: the client is gone
    except BaseException:
        writer.abort()
        raise
    await run_in_threadpool(writer.commit)
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
    progress = await run_in_threadpool(create_model, spec, catalogue)
    return await _progress(progress, body.stream)


@router.post("/api/pull", summary="pull a model from a registry (Ollama's by default; $PEBBLING_REGISTRY)")
async def pull(body: PullRequest) -> Response:
    progress = pull_model(_name(body), insecure=body.insecure)
    return await _progress(progress, body.stream)


@router.post("/api/copy", summary="give a model a second name")
async def copy(body: CopyRequest, request: Request) -> Response:
    await run_in_threadpool(copy_model, body.source, body.destination, engine_of(request).catalogue)
    return Response(status_code=200)


@router.delete("/api/delete", summary="delete a model from Ollama's store (and the blobs only it used)")
async def delete(body: DeleteRequest, request: Request) -> Response:
    name = _name(body)
    try:
        await run_in_threadpool(delete_model, name)
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


async def _progress(progress: Iterator[dict[str, Any]], stream: bool) -> Response:
    if not stream:
        last = await run_in_threadpool(_last, progress)
        return JSONResponse(last)

    # The first two objects are taken before the status line goes out (a pull's second comes once the
    # manifest is in), so an error found at once is still an HTTP error; later ones end the stream with
    # an error line, as Ollama ends it.
    first = [item for item in [await run_in_threadpool(next, progress, None) for _ in range(2)] if item]

    def lines() -> Iterator[str]:
        for item in first:
            yield dumps(item) + "\n"
        try:
            for item in progress:
                yield dumps(item) + "\n"
        except Exception as exc:
            if not isinstance(exc, PebblingError):  # a bug: the log has its traceback
                logger.exception("a model transfer failed")
            yield dumps({"error": str(exc)}) + "\n"

    return StreamingResponse(lines(), media_type=NDJSON)


def _last(progress: Iterator[dict[str, Any]]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    for last in progress:
        pass
    return last

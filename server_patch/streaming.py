"""Between the async HTTP handlers and the engine's worker threads.

A generation runs on its model's worker thread; the handler waits for its events on the event loop
(woken by the worker, no thread held per waiting client). Whenever the handler stops listening (the
response ended, the client disconnected, or the handler was cancelled), the job is cancelled, so the
worker stops at the next token and frees what it held.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import AsyncIterator

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from pyplugin.serving import Engine, Final, GenerationRequest, Job, Output


class BadRequest(Exception):
    """The request asks for something pebbling does not do (HTTP 400); the message says what."""


# Fields a client may send that ask for what pebbling does not do (yet), with what each would do: a
# value other than a neutral one (None, false, empty, "none", "auto") is refused naming the field.
UNSUPPORTED = {
    "logit_bias": "logit bias", "functions": "function calls (send tools)",
    "function_call": "function calls (send tool_choice)",
}
_NEUTRAL = (None, False, "", "none", "auto", [], {})


def refuse_unsupported(body) -> None:
    for name, what in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if not any(value is n or (type(value) is type(n) and value == n) for n in _NEUTRAL):
            raise BadRequest(f"'{name}' asks for {what}, which pebbling does not support yet; leave it out")


def logprobs_wanted(logprobs, top_logprobs: int | None) -> int | None:
    """Ollama's and OpenAI chat's `logprobs` (a boolean) and `top_logprobs` (0 to 20) as the engine
    takes them: None for none, else how many of the most likely tokens to list beside each token."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest(f"'logprobs' must be true or false, got {dumps(logprobs)[:40]}")
    if not logprobs:
        if top_logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true")
        return None
    return top_logprobs or 0


def ollama_logprobs(logprobs: list[dict] | None) -> dict:
    """Ollama's `logprobs` field (its top_logprobs left out where none were asked for), or nothing."""
    if logprobs is None:
        return {}
    return {"logprobs": [{k: v for k, v in t.items() if k != "top_logprobs" or v} for t in logprobs]}


def engine_of(request: Request) -> Engine:
    return request.app.state.engine


async def submit(request: Request, engine_request: GenerationRequest) -> Job:
    # Validation may load the model from disk: off the event loop.
    return await run_in_threadpool(engine_of(request).submit, engine_request)


async def events(job: Job, request: Request | None = None) -> AsyncIterator[str | Final]:
    """The job's text pieces, then its Final. With `request`, a client that disconnects ends the
    iteration (for non-streaming responses; streaming ones are cancelled by Starlette instead)."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def notify() -> None:
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop has shut down; the job was cancelled with it
            pass

    job.on_event(notify, final_only=request is not None)  # a response sent whole waits for its end only
    left = asyncio.ensure_future(_disconnected(request)) if request is not None else None
    try:
        while True:
            wake.clear()  # before drain: an event queued after it sets the flag again
            items = job.drain()
            for item in items:
                yield item
            if job.finished:
                return
            if items:
                continue  # drain again before sleeping: an error may be held back for the next call
            waiter = asyncio.ensure_future(wake.wait())
            try:
                done, _ = await asyncio.wait({waiter, left} if left else {waiter},
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if left is not None and left in done:
                return
    finally:
        job.cancel()  # a no-op once the job has finished
        if left is not None:
            left.cancel()


async def collect(job: Job, request: Request) -> tuple[str, Final | None]:
    """The whole response: (text, final); final is None if the client left first."""
    pieces, final = [], None
    async for item in events(job, request):
        if isinstance(item, Final):
            final = item
        else:
            pieces.append(item)
    return "".join(pieces), final


async def outputs(job: Job, request: Request | None = None) -> AsyncIterator[Output | Final]:
    """As `events`, with the text split by the job's parser into content, thinking and tool calls (a
    call comes once it is complete); empty outputs are left out."""
    parser, held = job.parser, None  # held: logprobs of text the parser keeps back, sent with what comes of it
    async for item in events(job, request):
        if isinstance(item, Final):
            rest = parser.finish() if parser is not None else Output()
            if rest or held:
                rest.logprobs = held
                yield rest
            yield item
        else:
            if getattr(item, "logprobs", None) is not None:
                held = (held or []) + item.logprobs
            out = parser.feed(item) if parser is not None else Output(item)
            if out:
                out.logprobs, held = held, None
                yield out


async def collect_output(job: Job, request: Request) -> tuple[Output, Final | None]:
    """The whole reply, split: (output, final); final is None if the client left first."""
    whole, final = Output(), None
    async for item in outputs(job, request):
        if isinstance(item, Final):
            final = item
        else:
            whole.content += item.content
            whole.thinking += item.thinking
            whole.tool_calls += item.tool_calls
            whole.cut_call = item.cut_call or whole.cut_call
    return whole, final


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def now_iso() -> str:
    """Ollama's created_at: RFC 3339 in UTC with microseconds."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now_unix() -> int:
    return int(time.time())


def dumps(obj) -> str:
    """Compact JSON, as Ollama writes its stream lines."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)

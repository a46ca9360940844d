"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (streaming as server-sent
events, ending with ``data: [DONE]``) and /v1/models, mapped onto the same engine as Ollama's API.

pebbling's options may ride along as top-level fields (pebbling_strategy, pebbling_enabled,
pebbling_memory_limit, pebbling_weights) or in an Ollama-style ``options`` object (OpenAI clients'
``extra_body``); the final response carries the ``pebbling`` report beside ``usage``.
"""

from __future__ import annotations

import base64
import codecs
import secrets
from typing import Any, Callable

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pyplugin.serving import Final, GenerationRequest, Output

from .replies import openai_calls, openai_messages, openai_tools
from .streaming import (BadRequest, collect, collect_output, dumps, engine_of, events, logprobs_wanted, now_unix,
                        outputs, refuse_unsupported, submit)
from .schemas import ChatCompletionRequest, CompletionRequest, OpenAIEmbeddingsRequest

router = APIRouter(prefix="/v1", tags=["openai"])
# /v1/completions without max_tokens writes this many tokens per choice, OpenAI's documented default for
# the legacy endpoint (its clients expect a short answer, not one that runs to the end of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_FINISH = {"stop": "stop", "length": "length"}


def _options(body, max_tokens: int | None) -> dict[str, Any]:
    refuse_unsupported(body)
    if body.n != 1 and body.stream:
        raise BadRequest(f"'n' is {body.n} with stream: several choices are generated only without stream")
    # OpenAI's defaults where the client sets nothing, as Ollama's compatibility layer does.
    options: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, **(body.options or {})}
    given = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "stop": body.stop,
             "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
             "num_predict": max_tokens, "pebbling_strategy": body.pebbling_strategy,
             "pebbling_enabled": body.pebbling_enabled, "pebbling_memory_limit": body.pebbling_memory_limit,
             "pebbling_weights": body.pebbling_weights}
    options.update({k: v for k, v in given.items() if v is not None})
    return options


def _text_content(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"messages[{index}].content: only text parts are supported "
                             "({\"type\": \"text\", \"text\": ...}); pebbling serves text-only models")
        return "".join(p["text"] for p in content)
    raise BadRequest(f"messages[{index}].content must be a string or a list of text parts")


def _format(response_format: dict | None) -> Any:
    """OpenAI's response_format as Ollama's format: None, "json" (json_object) or the JSON schema."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object")
        return spec["schema"]
    raise BadRequest(f"'response_format.type' must be text, json_object or json_schema, got {str(kind)[:40]!r}")


def _finish(f: Final, called: bool) -> str:
    reason = _FINISH.get(f.done_reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    fmt = _format(body.response_format)
    messages = openai_messages(body, _text_content)
    tools, tool_choice, think = openai_tools(body)
    options = _options(body, body.max_completion_tokens or body.max_tokens)
    top = logprobs_wanted(body.logprobs, body.top_logprobs)

    def make(opts: dict) -> GenerationRequest:
        return GenerationRequest(model=body.model, messages=messages, format=fmt, options=opts,
                                 keep_alive=body.keep_alive, tools=tools, tool_choice=tool_choice, think=think,
                                 logprobs=top)

    def logprobs(entries: list[dict] | None) -> dict | None:
        return None if top is None else {"content": entries or [], "refusal": None}

    job = await submit(request, make(options))
    base = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": now_unix(), "model": body.model,
            "system_fingerprint": "fp_pebbling"}

    if body.stream:
        calls = [0]  # calls sent so far: the index of the next

        def chunk(out: Output | None, f: Final | None) -> dict:
            delta: dict[str, Any] = {}
            if out is not None:
                delta = {"role": "assistant"}
                if out.content or not (out.thinking or out.tool_calls):
                    delta["content"] = out.content
                if out.thinking:  # both names clients read it under (Ollama's `reasoning`, DeepSeek's)
                    delta["reasoning"] = delta["reasoning_content"] = out.thinking
                if out.tool_calls:
                    delta["tool_calls"] = openai_calls(out.tool_calls, calls[0], index=True)
                    calls[0] += len(out.tool_calls)
            return {**base, "object": "chat.completion.chunk", "choices": [{
                "index": 0, "delta": delta, "logprobs": logprobs(out.logprobs) if out is not None else None,
                "finish_reason": _finish(f, calls[0] > 0) if f else None}]}
        return _sse(outputs(job), chunk, body.stream_options and body.stream_options.include_usage, base,
                    "chat.completion.chunk")
    results = await _choices(request, job, body.n, make, options, collect_output)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this

    def message(out: Output) -> dict:
        # OpenAI: content null when the reply is only calls
        m: dict[str, Any] = {"role": "assistant", "content": out.content or (None if out.tool_calls else "")}
        if out.thinking:
            m["reasoning"] = m["reasoning_content"] = out.thinking
        if out.tool_calls:
            m["tool_calls"] = openai_calls(out.tool_calls)
        return m

    return JSONResponse({**base, "object": "chat.completion", "choices": [{
        "index": i, "message": message(out), "logprobs": logprobs(f.logprobs),
        "finish_reason": _finish(f, bool(out.tool_calls))} for i, (out, f) in enumerate(results)],
        "usage": _usage_of(results), "pebbling": results[-1][1].report})


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    if body.echo:
        raise BadRequest("'echo' is not supported by pebbling")
    # A completion continues the prompt as written: no chat template; with a suffix, the fill-in-the-middle
    # prompt as /api/generate makes it.
    max_tokens = body.max_tokens
    if max_tokens is None and "num_predict" not in (body.options or {}):
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    options = _options(body, max_tokens)
    top = _legacy_logprobs_wanted(body)
    raw = not body.suffix
    job = await submit(request, GenerationRequest(model=body.model, prompt=body.prompt, suffix=body.suffix, raw=raw,
                                                  options=options, keep_alive=body.keep_alive, logprobs=top))
    base = {"id": f"cmpl-{secrets.token_hex(12)}", "created": now_unix(), "model": body.model,
            "system_fingerprint": "fp_pebbling"}

    def choice(text: str, f: Final | None, index: int = 0, entries: list[dict] | None = None,
               offset: int = 0) -> dict:
        return {"text": text, "index": index,
                "logprobs": None if top is None else _legacy_logprobs(entries or [], offset),
                "finish_reason": _FINISH.get(f.done_reason, "stop") if f else None}

    if body.stream:
        sent = [0]  # characters streamed so far: where the next chunk's text_offset starts

        def chunk(text: str | None, f: Final | None) -> dict:
            out = choice(text or "", f, 0, getattr(text, "logprobs", None), sent[0])
            sent[0] += len(text or "")
            return {**base, "object": "text_completion", "choices": [out]}
        return _sse(events(job), chunk, body.stream_options and body.stream_options.include_usage, base,
                    "text_completion")
    results = await _choices(request, job, body.n, lambda opts: GenerationRequest(
        model=body.model, prompt=body.prompt, suffix=body.suffix, raw=raw, options=opts, keep_alive=body.keep_alive,
        logprobs=top),
        options, collect)
    if results is None:
        return Response(status_code=499)
    return JSONResponse({**base, "object": "text_completion",
                         "choices": [choice(text, f, i, f.logprobs) for i, (text, f) in enumerate(results)],
                         "usage": _usage_of(results), "pebbling": results[-1][1].report})


def _legacy_logprobs_wanted(body: CompletionRequest) -> int | None:
    """The completions API's `logprobs`: N, the chosen token's logprob and the N most likely (0 to 20)."""
    if body.top_logprobs is not None:
        raise BadRequest("'top_logprobs' belongs to the chat API; on /v1/completions send 'logprobs': N")
    if body.logprobs is None:
        return None
    if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
        raise BadRequest(f"'logprobs' on /v1/completions is a number of most likely tokens (0 to 20), "
                         f"got {dumps(body.logprobs)[:40]}")
    return body.logprobs


def _legacy_logprobs(entries: list[dict], offset: int) -> dict:
    """The completions API's logprobs object: tokens, their logprobs, {token: logprob} of the most
    likely ones, and where each token's text starts in the choice's text: the characters completed
    before it, counted from `offset` (a character split across tokens counts once it is whole)."""
    utf8, starts = codecs.getincrementaldecoder("utf-8")(errors="replace"), []
    for e in entries:
        starts.append(offset)
        offset += len(utf8.decode(bytes(e["bytes"])))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": starts}


async def _choices(request: Request, first, n: int, make, options: dict, gather) -> list[tuple[Any, Final]] | None:
    """`n` choices: the job already submitted, then n - 1 more, one after the other on the model's queue;
    with a seed, choice i samples with seed + i, so that they differ and each can be reproduced."""
    results, job = [], first
    for i in range(n):
        if i:
            seed = options.get("seed")
            job = await submit(request, make({**options, **({"seed": seed + i} if seed is not None else {})}))
        text, f = await gather(job, request)
        if f is None:
            return None
        results.append((text, f))
    return results


def _usage_of(results: list[tuple[Any, Final]]) -> dict[str, int]:
    """The prompt counted once (all of it, as OpenAI counts: the part found in the cache is said in
    prompt_tokens_details), the completions of every choice."""
    first = results[0][1]
    cached = (first.report or {}).get("cached_tokens") or 0
    prompt, completion = first.prompt_eval_count + cached, sum(f.eval_count for _, f in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@router.get("/models")
async def models(request: Request) -> dict:
    listings = await run_in_threadpool(engine_of(request).list_models)
    return {"object": "list", "data": [{"id": m.name, "object": "model", "created": int(m.modified),
                                        "owned_by": "pebbling"} for m in listings]}


@router.get("/models/{model:path}")
async def model(model: str, request: Request) -> dict:
    """One model, as /v1/models lists it (OpenAI clients' models.retrieve); 404 for an unknown name."""
    listing, _ = await run_in_threadpool(engine_of(request).show, model)
    return {"id": listing.name, "object": "model", "created": int(listing.modified), "owned_by": "pebbling"}


def _sse(items, chunk: Callable[[Any, Final | None], dict], include_usage: bool | None,
         base: dict, obj: str) -> StreamingResponse:
    """`items`: the job's events (text) or outputs (split text), each made a chunk."""
    def event(data: Any) -> str:
        return f"data: {dumps(data)}\n\n"

    async def stream():
        try:
            async for item in items:
                if isinstance(item, Final):
                    last = chunk(None, item)
                    last["pebbling"] = item.report
                    yield event(last)
                    if include_usage:  # OpenAI: one more chunk, no choices, with the usage
                        yield event({**base, "object": obj, "choices": [], "usage": _usage_of([("", item)])})
                else:
                    yield event(chunk(item, None))
        except Exception as exc:  # headers are sent: the error becomes an event, as OpenAI does
            yield event({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.post("/embeddings")
async def embeddings(body: OpenAIEmbeddingsRequest, request: Request) -> Response:
    texts = [body.input] if isinstance(body.input, str) else body.input
    if any(not isinstance(t, str) for t in texts):
        raise BadRequest("'input': token-id arrays are not supported (ids of another tokenizer mean nothing to "
                         "this model); send text (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)")
    if body.encoding_format not in ("float", "base64"):
        raise BadRequest(f"'encoding_format' must be float or base64, got {body.encoding_format!r}")
    given = {"pebbling_strategy": body.pebbling_strategy, "pebbling_memory_limit": body.pebbling_memory_limit,
             "pebbling_weights": body.pebbling_weights}
    options = {**(body.options or {}), **{k: v for k, v in given.items() if v is not None}}
    job = await submit(request, GenerationRequest(model=body.model, embed=texts, dimensions=body.dimensions,
                                                  options=options, keep_alive=body.keep_alive))
    _, f = await collect(job, request)
    if f is None:
        return Response(status_code=499)

    def encoded(vector: list[float]):
        return vector if body.encoding_format == "float" else \
            base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()

    return JSONResponse({"object": "list", "model": body.model,
                         "data": [{"object": "embedding", "index": i, "embedding": encoded(v)}
                                  for i, v in enumerate(f.embeddings)],
                         "usage": {"prompt_tokens": f.prompt_eval_count, "total_tokens": f.prompt_eval_count}})

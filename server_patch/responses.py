"""OpenAI's Responses API, /v1/responses, for text: `input` as a string or a list of items (messages with
text content, function calls and their outputs), `instructions`, function tools (calls answered as
output items of type function_call), `text.format` (JSON or a JSON schema), and streaming as OpenAI's
server-sent events: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta ... done, response.function_call_arguments.delta
... done, response.output_item.done, and response.completed (response.incomplete at max_output_tokens).

Nothing is stored: a request that refers to an earlier response (previous_response_id) is refused, and
the conversation is sent whole in `input`, as the Chat Completions API sends it.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BeforeValidator, Field

from pyplugin.serving import CutCall, Final, GenerationRequest, Output, ToolCall

from .schemas import _Body
from .streaming import BadRequest, collect_output, dumps, now_unix, outputs, submit

router = APIRouter(prefix="/v1", tags=["openai"])
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class InputItem(_Body):
    """One item of `input`, each field typed, so that a value of the wrong kind (an object where a role is
    named, say) is a 400 naming its place (input.0.role) and what is accepted, before any of it is used."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = Field(
        "message", description="reasoning items (a model's earlier thinking) are skipped, as templates drop them")
    role: Literal["user", "assistant", "system", "developer"] | None = Field(
        None, description="a message's; developer is read as system")
    content: Any = Field(None, description="a message's: a string or a list of input_text parts")
    name: str | None = Field(None, description="a function_call's function")
    call_id: str | None = Field(None, description="a function_call's id; a function_call_output: the call it answers")
    arguments: Any = Field(None, description="a function_call's: a JSON object, or its text")
    output: str | None = Field(None, description="a function_call_output's result")


def _as_items(value: Any) -> Any:
    """`input` as a string is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class ResponsesRequest(_Body):
    model: str
    input: Annotated[list[InputItem], BeforeValidator(_as_items)] = Field(
        description="a string (a user message), or a list of items: messages {role, content}, function_call and "
                    "function_call_output items")
    instructions: str | None = Field(None, description="a system message put first")
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = Field(None, description='function tools: [{"type": "function", "name", '
                                                      '"description", "parameters"}]')
    tool_choice: Any = Field(None, description='"auto", "none", "required" or {"type": "function", "name"}')
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text" | "json_object" | '
                                                          '"json_schema", "schema"}}')
    reasoning: dict[str, Any] | None = Field(None, description='{"effort": "none"} turns thinking off, any other '
                                                               'effort on (levels are not told apart); the '
                                                               'thinking comes as a reasoning output item')
    think: bool | str | None = Field(None, description="pebbling extension, as Ollama's think: true, false or a "
                                     "level (low, medium, high: gpt-oss's reasoning effort)")
    previous_response_id: str | None = Field(None, description="not supported: responses are not stored")
    background: bool | None = Field(None, description="not supported")
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = None
    options: dict[str, Any] | None = Field(None, description="pebbling extension: Ollama's options")
    keep_alive: Any = None


@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    if body.previous_response_id:
        raise BadRequest("'previous_response_id' is not supported: pebbling stores no responses; send the "
                         "conversation in 'input'")
    if body.background:
        raise BadRequest("'background' is not supported: send the request and wait for it (or stream it)")
    tools, choice = _tools(body.tools, body.tool_choice)
    options: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, **(body.options or {})}
    given = {"temperature": body.temperature, "top_p": body.top_p, "num_predict": body.max_output_tokens,
             "seed": body.seed}
    options.update({k: v for k, v in given.items() if v is not None})
    think = body.think
    effort = (body.reasoning or {}).get("effort")
    if think is None and effort is not None:  # a level: gpt-oss's reasoning effort, else thinking on
        think = False if effort == "none" else effort
    job = await submit(request, GenerationRequest(
        model=body.model, messages=_messages(body.input, body.instructions), format=_format(body.text),
        options=options, keep_alive=body.keep_alive, tools=tools, tool_choice=choice, think=think))
    shell = {"id": f"resp_{secrets.token_hex(12)}", "object": "response", "created_at": now_unix(),
             "model": body.model, "instructions": body.instructions, "tools": body.tools or [],
             "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
             "temperature": options["temperature"], "top_p": options["top_p"],
             "max_output_tokens": body.max_output_tokens, "text": body.text or {"format": {"type": "text"}},
             "metadata": body.metadata or {}, "previous_response_id": None, "error": None,
             "incomplete_details": None, "truncation": "disabled", "store": False}
    if body.stream:
        return StreamingResponse(_events(outputs(job), shell), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    out, f = await collect_output(job, request)
    if f is None:
        return Response(status_code=499)
    calls = [_call(c) for c in _calls(out)]
    items = _reasoning(out.thinking) + _message(out.content, cut=f.done_reason == "length" and not calls) + calls
    return JSONResponse(_finished(shell, items, f))


def _finished(shell: dict, items: list[dict], f: Final) -> dict:
    incomplete = f.done_reason == "length"
    cached = (f.report or {}).get("cached_tokens") or 0
    prompt = f.prompt_eval_count + cached
    return {**shell, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "output": items,
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": f.eval_count, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + f.eval_count},
            "pebbling": f.report}


# ---------------------------------------------------------------------------------------------------
# the request, as the engine takes it


def _messages(items: list[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if not items:
        raise BadRequest("'input' must be a string or a non-empty list of items (messages {\"role\", \"content\"}, "
                         "function_call and function_call_output items)")
    names: dict[str, str] = {}  # call id -> function name, for the output that answers it
    for i, item in enumerate(items):
        if item.type == "message":
            if item.role is None:
                raise BadRequest(f"input[{i}]: a message needs a role, one of {', '.join(ROLES)}")
            messages.append({"role": ROLES[item.role], "content": _text(item.content, f"input[{i}].content")})
        elif item.type == "function_call":
            name, call_id = item.name, item.call_id
            if name is None or call_id is None:
                raise BadRequest(f"input[{i}]: a function_call needs 'name' and 'call_id' strings")
            arguments = _arguments(item.arguments, f"input[{i}].arguments")
            names[call_id] = name
            call = {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # calls made together, in one turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            call_id, output = item.call_id, item.output
            if call_id is None or output is None:
                raise BadRequest(f"input[{i}]: a function_call_output needs 'call_id' and 'output' strings")
            message = {"role": "tool", "content": output, "tool_call_id": call_id}
            if call_id in names:
                message["name"] = message["tool_name"] = names[call_id]
            messages.append(message)
        # a reasoning item, a model's earlier thinking: templates drop it from past turns
    return messages


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str)
               for p in content):
            raise BadRequest(f"{where}: only text parts are supported ({{\"type\": \"input_text\", \"text\": ...}}); "
                             "pebbling serves text-only models")
        return "".join(p["text"] for p in content)
    raise BadRequest(f"{where} must be a string or a list of input_text parts")


def _arguments(arguments: Any, where: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else arguments or {}
    except ValueError:
        raise BadRequest(f"{where} is not JSON: {str(arguments)[:60]!r}") from None
    if not isinstance(parsed, dict):
        raise BadRequest(f"{where} must be a JSON object")
    return parsed


def _tools(tools: list[Any] | None, choice: Any) -> tuple[list[dict] | None, Any]:
    """The Responses API's flat function tools ({"type": "function", "name", ...}) as chat templates take
    them, and tool_choice as the engine takes it."""
    if not tools or choice == "none":
        if choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools': send the tools it may choose from")
        return None, None
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}]: only function tools are supported ({{\"type\": \"function\", \"name\", "
                             f"\"parameters\"}}), got {dumps(tool)[:80]}")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\"}}, "
                             f"got {dumps(choice)[:80]}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "auto", "required"):
        raise BadRequest(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\"}}, "
                         f"got {dumps(choice)[:80]}")
    return converted, choice


def _format(text: dict[str, Any] | None) -> Any:
    spec = (text or {}).get("format") or {"type": "text"}
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema" and isinstance(spec.get("schema"), dict):
        return spec["schema"]
    raise BadRequest("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                     "\"json_schema\", \"name\", \"schema\": {...}}")


# ---------------------------------------------------------------------------------------------------
# output items and the event stream


def _reasoning(text: str) -> list[dict]:
    return [{"type": "reasoning", "id": f"rs_{secrets.token_hex(12)}", "summary": [],
             "content": [{"type": "reasoning_text", "text": text}]}] if text else []


def _message(text: str, item_id: str | None = None, *, cut: bool = False) -> list[dict]:
    """The reply's text as a message item; `cut`: the token limit ended it (status incomplete)."""
    if not text and item_id is None:
        return []
    return [{"type": "message", "id": item_id or f"msg_{secrets.token_hex(12)}",
             "status": "incomplete" if cut else "completed", "role": "assistant", "content": [_text_part(text)]}]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _calls(out: Output) -> list[ToolCall | CutCall]:
    """The calls of an output, then the forced call the token limit cut short, if it did."""
    return [*(out.tool_calls or ()), *([out.cut_call] if out.cut_call else [])]


def _call(call: ToolCall | CutCall) -> dict:
    """A call as a function_call item: a cut one (CutCall) is incomplete, its arguments the JSON text written."""
    cut = isinstance(call, CutCall)
    return {"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": f"call_{secrets.token_hex(12)}",
            "name": call.name, "arguments": call.arguments if cut else json.dumps(call.arguments, ensure_ascii=False),
            "status": "incomplete" if cut else "completed"}


async def _events(items: AsyncIterator[Output | Final], shell: dict) -> AsyncIterator[str]:
    sequence = [0]

    def event(kind: str, **data: Any) -> str:
        data = {"type": kind, "sequence_number": sequence[0], **data}
        sequence[0] += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"

    start = {**shell, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    done: list[dict] = []
    thinking, text, message_id = "", "", None

    def close_message(cut: bool = False) -> list[str]:
        nonlocal message_id, text
        if message_id is None:
            return []
        item = _message(text, message_id, cut=cut)[0]
        whole, index, message_id, text = text, len(done), None, ""
        done.append(item)
        return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=whole, logprobs=[]),
                event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=_text_part(whole)),
                event("response.output_item.done", output_index=index, item=item)]

    def close_reasoning() -> list[str]:
        nonlocal thinking
        if not thinking:
            return []
        item, thinking = _reasoning(thinking)[0], ""
        done.append(item)
        index = len(done) - 1
        return [event("response.output_item.added", output_index=index, item={**item, "content": []}),
                event("response.output_item.done", output_index=index, item=item)]

    try:
        async for out in items:
            if isinstance(out, Final):
                for line in close_reasoning() + close_message(cut=out.done_reason == "length"):
                    yield line
                final = _finished(shell, done, out)
                yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                            response=final)
                return
            thinking += out.thinking or ""
            if out.content:
                for line in close_reasoning():
                    yield line
                if message_id is None:
                    message_id = f"msg_{secrets.token_hex(12)}"
                    index = len(done)
                    yield event("response.output_item.added", output_index=index, item={
                        "type": "message", "id": message_id, "status": "in_progress", "role": "assistant",
                        "content": []})
                    yield event("response.content_part.added", item_id=message_id, output_index=index,
                                content_index=0, part=_text_part(""))
                text += out.content
                yield event("response.output_text.delta", item_id=message_id, output_index=len(done),
                            content_index=0, delta=out.content, logprobs=[])
            for call in _calls(out):
                for line in close_reasoning() + close_message():
                    yield line
                item, index = _call(call), len(done)
                done.append(item)
                yield event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
    except Exception as exc:  # the headers are sent: the error becomes an event, as OpenAI sends it
        yield event("error", code=None, message=str(exc), param=None)

"""Messages with tool calls, tool results and thinking, between the APIs' shapes and the one chat templates
take (Hugging Face's convention: {"type": "function", "function": {"name", "arguments": {...}}}, a tool
result under role "tool" with its function's `name`, thinking as `reasoning_content`), and calls as each
API answers them.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pyplugin.serving import ToolCall

from .schemas import ChatCompletionRequest, Message
from .streaming import BadRequest


def template_tool_call(call: Any, where: str) -> dict:
    """A call sent back in a message, as chat templates take it (Hugging Face's convention): {"type":
    "function", "function": {"name", "arguments": {...}}}, the arguments an object even where OpenAI
    sends them as a JSON string."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where} must be {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}, got "
                         f"{json.dumps(call)[:80]}")
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise BadRequest(f"{where}.function.arguments is not JSON: {args[:60]!r}") from None
    if not isinstance(args, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": args}}
    return {**out, "id": call["id"]} if isinstance(call.get("id"), str) else out


def chat_message(m: Message, i: int) -> dict[str, Any]:
    """A message as chat templates take it: tool calls in Hugging Face's form, a tool result's
    function under `name` (and Ollama's `tool_name`), thinking as `reasoning_content`."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [template_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                             for j, c in enumerate(m.tool_calls)]
    if m.tool_name:
        out["name"] = out["tool_name"] = m.tool_name
    if m.thinking:
        out["reasoning_content"] = out["thinking"] = m.thinking
    return out


# ---------------------------------------------------------------------------------------------------
# OpenAI


def openai_messages(body: ChatCompletionRequest, text_content) -> list[dict[str, Any]]:
    """The messages as chat templates take them: calls with their arguments as objects, a tool result
    with the id of the call it answers and the function's name, thinking as `reasoning_content` and
    `thinking`."""
    names = {}  # call id -> function name, so that a tool result can be given its function's name
    messages = []
    for i, m in enumerate(body.messages):
        # "developer": OpenAI's newer name for the system role (its clients send it for some models)
        out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": text_content(m.content, i)}
        if m.tool_calls:
            out["tool_calls"] = [template_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(m.tool_calls)]
            names.update({c["id"]: c["function"]["name"] for c in out["tool_calls"] if "id" in c})
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        name = m.name or (names.get(m.tool_call_id) if m.role == "tool" else None)
        if name:
            out["name"] = out["tool_name"] = name
        if m.reasoning_content:  # under both names templates read it by (gpt-oss's: `thinking`), as chat_message
            out["reasoning_content"] = out["thinking"] = m.reasoning_content
        messages.append(out)
    if not messages:
        raise BadRequest("'messages' must hold at least one message")
    return messages


def openai_tools(body: ChatCompletionRequest) -> tuple[list | None, Any, bool | None]:
    """(tools, tool_choice, think) for the engine: tool_choice "none" offers no tools; parallel_tool_calls
    false is kept where a forced call makes it so, refused where the model would choose."""
    choice = body.tool_choice
    if choice == "none" or not body.tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools': send the tools it may choose from")
        tools = None
    else:
        tools = body.tools
        if body.parallel_tool_calls is False and choice in (None, "auto"):
            raise BadRequest("'parallel_tool_calls': false is honoured with tool_choice \"required\" or a named "
                             "function (exactly one call); with \"auto\" pebbling cannot bound the calls: leave it "
                             "out")
    think = body.think
    if body.reasoning_effort == "none":  # OpenAI's "no reasoning": thinking off, where a model thinks
        think = False if think is None else think
    elif body.reasoning_effort is not None and think is None:  # a level: gpt-oss's effort, else thinking on
        think = body.reasoning_effort
    return tools, choice if tools else None, think


def openai_calls(calls: list[ToolCall], first: int = 0, *, index: bool = False) -> list[dict]:
    return [{**({"index": first + i} if index else {}), "id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(calls)]

"""Ollama's request values as its Go templates see them: messages (with their tool calls), tools (their
functions and parameters, and api.Tool's JSON text), and a chat collated into system text and turns."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from .go_functions import GoFields, GoMap, GoStruct, go_json


def tool(tool: Mapping[str, Any]) -> GoStruct:
    function = tool.get("function") or {}
    params = function.get("parameters") or {}
    properties = {name: GoStruct({"Type": p.get("type"), "Description": p.get("description", ""),
                                  "Enum": p.get("enum"), "Items": p.get("items")})
                  for name, p in (params.get("properties") or {}).items()}
    # api.Tool's String: its JSON, fields in the struct's order, maps with sorted keys.
    shown = GoFields({"type": tool.get("type", "function"), "function": GoFields({
        "name": function.get("name", ""), "description": function.get("description", ""),
        "parameters": GoFields({"type": params.get("type", "object"),
                                **({"$defs": params["$defs"]} if "$defs" in params else {}),
                                "required": params.get("required"),
                                "properties": {k: _property(v) for k, v in (params.get("properties") or {}).items()}})})})
    struct = GoStruct({"Type": shown["type"], "Function": GoStruct({
        "Name": function.get("name", ""), "Description": function.get("description", ""),
        "Parameters": GoStruct({"Type": params.get("type", "object"), "Required": params.get("required") or [],
                                "Properties": GoMap(properties)})}, text=go_json(shown["function"]))},
        text=go_json(shown))
    struct.json = shown  # type: ignore[attr-defined]
    return struct


def _property(p: Mapping[str, Any]) -> dict:
    out = GoFields({"type": p.get("type")})
    if "items" in p:
        out["items"] = p["items"]
    out["description"] = p.get("description", "")
    if "enum" in p:
        out["enum"] = p["enum"]
    return out


def go_message(message: Mapping[str, Any]) -> GoStruct:
    """An api.Message as a template sees it."""
    calls = []
    for n, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):  # OpenAI's form: a JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {}
        args = GoMap(arguments)
        args_struct = GoStruct(args, text=go_json(dict(args)))
        calls.append(GoStruct({"ID": call.get("id", ""), "Function": GoStruct({
            "Index": function.get("index", n), "Name": function.get("name", ""), "Arguments": args_struct})}))
    return GoStruct({"Role": message.get("role", ""), "Content": message.get("content") or "",
                     "Thinking": message.get("thinking") or "", "Images": message.get("images") or [],
                     "ToolCalls": calls, "ToolName": message.get("tool_name") or message.get("name") or "",
                     "ToolCallID": message.get("tool_call_id") or ""})


def collate(messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict]]:
    """Ollama's collate: every system message joined; consecutive messages of one role (but tool) merged."""
    system, out = [], []
    for m in messages:
        m = dict(m)
        if m.get("role") == "system":
            system.append(m.get("content") or "")
        if out and out[-1].get("role") == m.get("role") and m.get("role") != "tool":
            out[-1]["content"] = (out[-1].get("content") or "") + "\n\n" + (m.get("content") or "")
        else:
            out.append(m)
    return "\n\n".join(system), out

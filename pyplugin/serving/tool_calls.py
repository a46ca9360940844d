"""Tool calls: which format a model writes them in, the grammar that forces one, and the parser that finds
them in its output as it streams.

The format is read from the model's chat template text (a Jinja template from the GGUF file or an Ollama
Go template alike), as Ollama reads it: a template that never mentions tools cannot offer them. Four
formats cover the families pebbling loads:

- "qwen": Qwen2.5 / Qwen3 (Hermes style), each call a JSON object in ``<tool_call>...</tool_call>``;
- "llama3": Llama 3.1+, a bare JSON object ``{"name": ..., "parameters": {...}}``, perhaps after
  ``<|python_tag|>``, several separated by ``;``;
- "json": the fallback for any other template that takes tools: a bare JSON object with ``name`` and
  ``arguments``, as Ollama's generic parser reads it;
- "harmony": gpt-oss's, a commentary message addressed to the function, its arguments the message
  (serving/harmony.py parses it; a forced call is that message's header and arguments);
- "gemma4": Gemma 4's, ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` in its own notation
  (serving/gemma4.py parses it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import OptionsError
from ..runtime.constraint import closed_objects

TOOLS_HELP = ('a list of {"type": "function", "function": {"name": ..., "description": ..., '
              '"parameters": {JSON schema}}}')
TOOL_CHOICE_HELP = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolFormat:
    name: str           # "qwen", "llama3" or "json"
    open: str = ""      # the tag before each call ("" for a bare JSON object)
    close: str = ""
    arguments: str = "arguments"  # the key the arguments are written under
    prefix: str = ""    # a marker a bare call may start with (Llama's <|python_tag|>)


QWEN = ToolFormat("qwen", "<tool_call>", "</tool_call>")
HARMONY = ToolFormat("harmony")  # gpt-oss: a call is a commentary message to the function (serving/harmony.py)
GEMMA4 = ToolFormat("gemma4", "<|tool_call>", "<tool_call|>")  # Gemma 4: its notation, not JSON (serving/gemma4.py)
LLAMA3 = ToolFormat("llama3", arguments="parameters", prefix="<|python_tag|>")
GENERIC = ToolFormat("json")


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes OpenAI's harmony format (gpt-oss's: serving/harmony.py)."""
    return bool(template) and "<|channel|>" in template and "<|message|>" in template


def is_gemma4(template: str | None) -> bool:
    """Whether a chat template writes Gemma 4's format (its turn and channel markers: serving/gemma4.py)."""
    return bool(template) and "<|turn>" in template and "<|channel>" in template


def tool_format(template: str | None) -> ToolFormat | None:
    """The format a model with this chat template writes calls in; None if the template takes no tools
    (Jinja's ``tools`` variable, Go's ``.Tools``)."""
    if not template or not re.search(r"\btools\b|\.Tools\b", template):
        return None
    if is_harmony(template):
        return HARMONY
    if is_gemma4(template):
        return GEMMA4
    if "<tool_call>" in template:
        return QWEN
    if "<|python_tag|>" in template or '"parameters"' in template or "ipython" in template:
        return LLAMA3
    return GENERIC


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CutCall:
    """The call a forced output (tool_choice) was writing when the token limit ended it: never content, and
    never a call to make. `name`: the function's, where it was written whole (else the one tool it could be,
    else ""); `arguments`: their JSON text so far."""

    name: str
    arguments: str = ""


_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


# ---------------------------------------------------------------------------------------------------
# the request's tools


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's tools, each checked: a function with a name and a parameters schema (object)."""
    if not isinstance(tools, list):
        raise OptionsError(f"tools: got {type(tools).__name__}; accepted: {TOOLS_HELP}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise OptionsError(f"tools[{i}]: got {json.dumps(tool)[:80]}; accepted: {TOOLS_HELP}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise OptionsError(f"tools[{i}].function.name must be a non-empty string; accepted: {TOOLS_HELP}")
        if not isinstance(function.get("parameters", {}), dict):
            raise OptionsError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def forced_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools one of which the output must call (`required`: any, a named function: that one), or
    None when the model chooses (`auto`)."""
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "required":
        return tools
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type", "function") != "function" \
            or not isinstance(function.get("name"), str):
        raise OptionsError(f"tool_choice: got {json.dumps(tool_choice)[:80]}; accepted: {TOOL_CHOICE_HELP}")
    named = [t for t in tools if t["function"]["name"] == function["name"]]
    if not named:
        raise OptionsError(f"tool_choice names {function['name']!r}, which is not among the tools "
                           f"({', '.join(tool_names(tools))})")
    return named


def call_grammar(fmt: ToolFormat, tools: list[dict[str, Any]]) -> str:
    """A Lark grammar (llguidance's) for exactly one call, in `fmt`, of one of `tools`, its arguments
    following the tool's parameters schema."""
    defs: dict[str, Any] = {}
    schemas = []
    for n, t in enumerate(tools):
        arguments = closed_objects(t["function"].get("parameters") or {"type": "object"})
        if _has_ref(arguments):  # its "#/..." references are to its own root: kept there, under the call's
            defs[f"tool{n}"] = _rebased(arguments, f"#/$defs/tool{n}")
            arguments = {"$ref": f"#/$defs/tool{n}"}
        schemas.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                         fmt.arguments: arguments},
                        "required": ["name", fmt.arguments], "additionalProperties": False})
    if fmt is HARMONY:  # the function is named in the message's header, its arguments are the message
        rules = []
        for n, (t, s) in enumerate(zip(tools, schemas)):
            arguments = {**s["properties"][fmt.arguments], **({"$defs": defs} if defs else {}),
                         "x-guidance": {"whitespace_flexible": False}}
            header = HARMONY_CALL.format(t["function"]["name"])
            rules.append(f"call{n}: {json.dumps(header)} args{n}\nargs{n}: %json {json.dumps(arguments)}\n")
        return f"start: {' | '.join(f'call{n}' for n in range(len(tools)))}\n" + "".join(rules)
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if defs:
        schema = {**schema, "$defs": defs}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    if fmt.open:
        body = f"{json.dumps(fmt.open + chr(10))} call {json.dumps(chr(10) + fmt.close)}"
    else:
        body = "call"
    return f"start: {body}\ncall: %json {json.dumps(schema)}\n"


HARMONY_CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"  # a forced call's header


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("$ref"), str) or any(_has_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _rebased(schema: Any, root: str) -> Any:
    """The schema with each local reference ("#", "#/$defs/P", ...) pointing below `root` instead: a tool's
    parameters (Pydantic's, with their "$defs") nested in the call's schema keep meaning what they meant."""
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


# ---------------------------------------------------------------------------------------------------
# parsing the output


def _as_call(value: Any, fmt: ToolFormat, names: set[str] | None) -> ToolCall | None:
    """A call if `value` reads as one ({"name": ..., "arguments" or "parameters": {...}}), else None.
    With `names`, only a tool that was offered counts (a bare JSON answer is not taken for a call)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    args = value.get(fmt.arguments, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(value["name"], args) if isinstance(args, dict) else None


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object that opens at text[start] ('{'), or None if it is not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept until more comes)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Splits text as it streams into content and calls. `feed(text)` and `finish()` return
    (content, calls): content is passed on at once, except what may still turn out to be part of a call.

    `forced`: the tools tool_choice forces one call of (the output follows call_grammar). Then the output
    holds no content at all: text left over at the end is that call, cut short by the token limit, kept as
    `cut` rather than passed on as content."""

    def __init__(self, fmt: ToolFormat, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None = None):
        self.fmt, self.names = fmt, set(tool_names(tools))
        self.forced = tool_names(forced) if forced else None
        self.cut: CutCall | None = None
        self._pending = ""
        self._in_call = False            # tagged: inside <tool_call>
        self._bare = None                # bare: None (undecided), True (reading calls), False (content)
        self._found = 0                  # bare: calls read so far
        self._calls = 0                  # calls returned so far

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content, calls = self._tagged(False) if self.fmt.open else self._bare_calls(False)
        self._calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._tagged(True) if self.fmt.open else self._bare_calls(True)
        self._calls += len(calls)
        if self.forced is not None and content:
            if not self._calls:
                self.cut = _cut_call(content, self.fmt, self.forced)
            content = ""
        return content, calls

    def _tagged(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls, fmt = [], [], self.fmt
        while True:
            if not self._in_call:
                at = self._pending.find(fmt.open)
                if at < 0:
                    keep = 0 if final else held_back(self._pending, fmt.open)
                    content.append(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content.append(self._pending[:at])
                self._pending, self._in_call = self._pending[at + len(fmt.open):], True
            at = self._pending.find(fmt.close)
            if at < 0 and not final:
                break
            # ended without the closing tag, or inside it: the call is what comes before
            body = self._pending[:len(self._pending) - held_back(self._pending, fmt.close)] if at < 0 \
                else self._pending[:at]
            try:  # a model may stop after the object without closing the tag
                call = _as_call(json.loads(body), fmt, None)
            except ValueError:
                call = None
            self._in_call = False
            if call is None:  # not a call after all: the tag was text, and a call may open after it
                content.append(fmt.open)
                continue
            calls.append(call)
            self._pending = "" if at < 0 else self._pending[at + len(fmt.close):]
            if at < 0:
                break
        return "".join(content), calls

    def _bare_calls(self, final: bool) -> tuple[str, list[ToolCall]]:
        """Llama 3 and the fallback: the reply is calls when it starts with a JSON object of an offered tool
        (or the prefix marker); otherwise content."""
        if self._bare is False:
            content, self._pending = self._pending, ""
            return content, []
        text, calls = self._pending, []
        pos = len(text) - len(text.lstrip())
        if self._bare is None:
            rest = text[pos:]
            if self.fmt.prefix and rest.startswith(self.fmt.prefix):
                pos, self._bare = pos + len(self.fmt.prefix), True
            elif rest.startswith("{"):
                self._bare = True
            elif not final and (not rest or (self.fmt.prefix and self.fmt.prefix.startswith(rest))):
                return "", []  # undecided yet
            else:
                return self._as_content()
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos == len(text):
                self._pending = ""
                return "", calls
            if text[pos] != "{":
                break
            end = _object_end(text, pos)
            if end is None:
                if not final:
                    self._pending = text[pos:]
                    return "", calls
                break
            try:
                call = _as_call(json.loads(text[pos:end]), self.fmt, self.names)
            except ValueError:
                call = None
            if call is None:
                break
            calls.append(call)
            self._found += 1
            pos = end
        # What follows the calls is content; so is the whole reply when it began with JSON that calls nothing.
        self._pending = text[pos:] if self._found else text
        content, _ = self._as_content()
        return content, calls

    def _as_content(self) -> tuple[str, list[ToolCall]]:
        self._bare = False
        content, self._pending = self._pending, ""
        return content, []


def _cut_call(text: str, fmt: ToolFormat, forced: list[str]) -> CutCall:
    """What there is of a call in `text`, a call_grammar's output that the token limit ended: the grammar
    writes the name first, then the arguments."""
    found = _NAME.search(text)
    try:
        name = json.loads(found.group(1)) if found else None
    except ValueError:
        name = None
    if not isinstance(name, str):
        name = forced[0] if len(forced) == 1 else ""
    rest = text[found.end():] if found else ""
    at = re.match(r'\s*,\s*"%s"\s*:\s*' % re.escape(fmt.arguments), rest)
    return CutCall(name, rest[at.end():] if at else "")

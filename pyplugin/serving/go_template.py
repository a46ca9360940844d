"""Ollama's prompt templates: Go's text/template, executed as Ollama executes them.

Ollama keeps a model's chat template as a Go template (a manifest's template layer, or a request's
`template` field). `GoTemplate(source).render_chat(messages, tools=..., think=...)` gives what Ollama's
`Template.Execute` gives: a template that reads `.Messages` gets the conversation (consecutive messages of
one role merged, every system message joined into `.System`), `.Tools`, `.Think` and `.IsThinkSet`; an
older template that reads only `.System`, `.Prompt` and `.Response` runs once per exchange, the last one
cut where `.Response` would be written. Values have Go's field names (`.Role`, `.Content`, `.ToolCalls`,
`.Function.Name`, `.Function.Arguments`, ...) and print as Go prints them: a tool or a call's arguments as
JSON, as Ollama's String methods write them. The functions are Go's (and, or, not, len, index, slice,
eq, ne, lt, le, gt, ge, print, printf, println) and Ollama's `json`.

Templates come from model files and from requests, so a rendering is bounded: at most MAX_OUTPUT
characters written, MAX_ITERATIONS passes through range bodies in all, MAX_SECONDS of time (checked in
every loop), and MAX_DEPTH levels of nesting (go_parse.py). A `{{range N}}` counts as it goes and never
builds its N items; one that could not finish within the iterations left is refused before it starts.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

from ..model.chat import MAX_OUTPUT, MAX_SECONDS
from .go_functions import GoMap, GoStruct, GoTemplateError, call as _call, text as _text, truth
from .go_parse import Action, Branch, Command, Dot, Field, Identifier, Literal, Loop, Pipe, TemplateSyntaxError, \
    Variable, parse
from .go_values import collate as _collate, go_message, tool as _tool

MAX_ITERATIONS = 1_000_000  # range bodies run per rendering, all loops together
# A rendering that has run this long (a real template takes well under a millisecond) goes on only in its
# turn, one such at a time, so that however many a client sends, one thread at most competes with the
# server's event loop for the interpreter; its time limit counts its own running, not its wait.
SLOW_RENDER_SECONDS = 0.05
_SLOW_TURN = threading.RLock()

__all__ = ["GoTemplate", "GoTemplateError", "TemplateSyntaxError", "go_message", "parsed", "render_go_template"]


# -- the template -----------------------------------------------------------------------------------------

class GoTemplate:
    """A parsed Go template (TemplateSyntaxError if it does not parse)."""

    def __init__(self, source: str):
        self.source = source
        self.nodes = parse(source)
        self.fields = {name.lower() for name in _identifiers(self.nodes)}
        self.chat_nodes = self.nodes
        if "messages" not in self.fields and "response" not in self.fields:  # Ollama appends {{ .Response }}
            self.chat_nodes = self.nodes + [Action(Pipe([Command([Field(("Response",))])]))]

    @property
    def reads_messages(self) -> bool:
        return "messages" in self.fields

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                    think: bool | None = None) -> str:
        system, collated = _collate(messages)
        flags = {"Think": bool(think), "IsThinkSet": think is not None}
        if self.reads_messages or "document" in self.fields:
            return _Run(self.chat_nodes, GoMap({"System": system, "Messages": [go_message(m) for m in collated],
                                      "Tools": [_tool(t) for t in tools or []], "Response": "", "Query": "",
                                      "Document": "", "Instruction": "", **flags})).text()
        # An older template: one rendering per exchange, the last cut where its response would go.
        out, values = [], {"System": "", "Prompt": "", "Response": ""}

        def flush() -> None:
            out.append(_Run(self.chat_nodes, GoMap({**values, **flags})).text())
            values.update(System="", Prompt="", Response="")

        for m in collated:
            role, content = m.get("role"), m.get("content") or ""
            if role == "system":
                if values["Prompt"] or values["Response"]:
                    flush()
                values["System"] = content
            elif role == "user":
                if values["Response"]:
                    flush()
                values["Prompt"] = content
            elif role == "assistant":
                values["Response"] = content
        out.append(_Run(_cut_at_response(self.chat_nodes)[0], GoMap({**values, **flags})).text())
        return "".join(out)

    def render(self, data: Mapping[str, Any]) -> str:
        return _Run(self.nodes, data if isinstance(data, GoStruct) else GoMap(data)).text()


CACHED_SOURCE = 64 * 1024  # characters: a real template is a few thousand


def parsed(source: str) -> GoTemplate:
    """The template of `source`, parsed once (a model's or a client's template comes back every request).
    Only sources up to CACHED_SOURCE are kept, so that the cache stays small whatever clients send."""
    return _parsed(source) if len(source) <= CACHED_SOURCE else GoTemplate(source)


@functools.lru_cache(maxsize=64)
def _parsed(source: str) -> GoTemplate:
    return GoTemplate(source)


def render_go_template(template: str, values: Mapping[str, str]) -> str:
    """A request's `template` with System, Prompt and Response given."""
    return parsed(template).render(values)


def _identifiers(nodes: Iterable) -> Iterable[str]:
    for node in nodes:
        if isinstance(node, Field):
            yield from node.names
            yield from _identifiers([node.receiver])
        elif isinstance(node, Action):
            yield from _identifiers([node.pipe])
        elif isinstance(node, Pipe):
            for command in node.commands:
                yield from _identifiers(command.args)
        elif isinstance(node, Branch):
            yield from _identifiers([node.pipe])
            yield from _identifiers(node.body)
            yield from _identifiers(node.otherwise or [])


def _has_response(node: Any) -> bool:
    return any(name == "Response" for name in _identifiers([node]))


def _cut_at_response(nodes: list) -> tuple[list, bool]:
    """The nodes up to the first that writes .Response (Ollama's deleteNode): conditions are kept, bodies
    are cut, and nothing after the cut survives."""
    out = []
    for node in nodes:
        if isinstance(node, Action) and _has_response(node):
            return out, True
        if isinstance(node, Branch):
            body, cut = _cut_at_response(node.body)
            otherwise, cut_else = (None, False) if node.otherwise is None else _cut_at_response(node.otherwise)
            out.append(Branch(node.kind, node.pipe, body, otherwise if not cut else
                              (None if node.otherwise is None else [])))
            if cut or cut_else:
                return out, True
            continue
        out.append(node)
    return out, False


# -- execution ---------------------------------------------------------------------------------------------

class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _Run:
    def __init__(self, nodes: list, data: Any):
        self.nodes, self.data = nodes, data
        self.out: list[str] = []
        self.size = 0
        self.iterations = 0
        self.started = time.monotonic()
        self.deadline = self.started + MAX_SECONDS
        self.in_turn = False  # holds _SLOW_TURN
        self.scopes: list[dict[str, Any]] = [{"$": data}]

    def text(self) -> str:
        try:
            self.run(self.nodes, self.data)
        except (_Break, _Continue):
            raise GoTemplateError("template: break or continue outside a range") from None
        except RecursionError:
            raise GoTemplateError("template: nested too deep") from None
        finally:
            if self.in_turn:
                _SLOW_TURN.release()
        return "".join(self.out)

    def write(self, text: str) -> None:
        self.size += len(text)
        if self.size > MAX_OUTPUT:
            raise GoTemplateError(f"template wrote more than {MAX_OUTPUT} characters; it was stopped")
        self.out.append(text)

    def check_time(self) -> None:
        now = time.monotonic()
        if not self.in_turn and now - self.started > SLOW_RENDER_SECONDS:
            _SLOW_TURN.acquire()
            self.in_turn = True
            waited = time.monotonic() - now
            self.deadline += waited
            now += waited
        if now > self.deadline:
            raise GoTemplateError(f"template rendering took more than {MAX_SECONDS:g} s; it was stopped")

    def run(self, nodes: list, dot: Any) -> None:
        self.check_time()
        for node in nodes:
            if isinstance(node, str):
                self.write(node)
            elif isinstance(node, Action):
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    self.write(_text(value))
            elif isinstance(node, Loop):
                raise _Break() if node.kind == "break" else _Continue()
            else:
                self.branch(node, dot)

    def branch(self, node: Branch, dot: Any) -> None:
        self.scopes.append({})
        try:
            if node.kind == "range":
                self.range(node, dot)
                return
            value = self.pipe(node.pipe, dot)
            if truth(value):
                self.run(node.body, value if node.kind == "with" else dot)
            elif node.otherwise is not None:
                self.run(node.otherwise, dot)
        finally:
            self.scopes.pop()

    def range(self, node: Branch, dot: Any) -> None:
        pipe = Pipe(node.pipe.commands)
        value = self.pipe(pipe, dot)
        items: Iterable[tuple[Any, Any]]
        if value is None:
            count, items = 0, ()
        elif isinstance(value, dict):
            count, items = len(value), ((k, value[k]) for k in sorted(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            count, items = max(value, 0), ((i, i) for i in range(value))  # counted, never built
        elif isinstance(value, (list, tuple)):
            count, items = len(value), enumerate(value)
        else:
            raise GoTemplateError(f"template: range can't iterate over {_text(value)[:40]!r}")
        left = MAX_ITERATIONS - self.iterations
        if count > left and not _may_break(node.body):
            raise GoTemplateError(f"template: range over {count} items is more than the {left} iterations this "
                                  f"rendering has left (at most {MAX_ITERATIONS} in all); it was refused")
        if not count:
            if node.otherwise is not None:
                self.run(node.otherwise, dot)
            return
        names = node.pipe.decl
        for key, item in items:
            self.iterations += 1
            if self.iterations > MAX_ITERATIONS:
                raise GoTemplateError(f"template: ranges ran more than {MAX_ITERATIONS} iterations; "
                                      "the rendering was stopped")
            if not self.iterations & 1023:
                self.check_time()
            scope = self.scopes[-1]
            if len(names) == 1:
                scope[names[0]] = item
            elif len(names) == 2:
                scope[names[0]], scope[names[1]] = key, item
            try:
                self.run(node.body, item)
            except _Break:
                break
            except _Continue:
                continue

    def variable(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise GoTemplateError(f"template: undefined variable {name}")

    def pipe(self, pipe: Pipe, dot: Any) -> Any:
        value, first = None, True
        for command in pipe.commands:
            value = self.command(command, dot, None if first else (value,))
            first = False
        if pipe.decl:
            if pipe.assign:
                for scope in reversed(self.scopes):
                    if pipe.decl[0] in scope:
                        scope[pipe.decl[0]] = value
                        break
                else:
                    raise GoTemplateError(f"template: undefined variable {pipe.decl[0]}")
            else:
                self.scopes[-1][pipe.decl[-1]] = value
        return value

    def command(self, command: Command, dot: Any, piped: tuple | None) -> Any:
        head, args = command.args[0], command.args[1:]
        if isinstance(head, Identifier):
            if head.name in ("and", "or"):
                operands = [lambda a=a: self.operand(a, dot) for a in args] + \
                    ([lambda: piped[0]] if piped else [])
                if not operands:
                    raise GoTemplateError(f"template: {head.name} needs at least one argument")
                for get in operands:
                    value = get()
                    if truth(value) != (head.name == "and"):
                        return value
                return value
            values = [self.operand(a, dot) for a in args] + (list(piped) if piped else [])
            return _call(head.name, values)
        if args or piped:
            raise GoTemplateError("template: only a function takes arguments")
        return self.operand(head, dot)

    def operand(self, node: Any, dot: Any) -> Any:
        if isinstance(node, Literal):
            return node.value
        if isinstance(node, Dot):
            return dot
        if isinstance(node, Variable):
            return self.variable(node.name)
        if isinstance(node, Identifier):
            return _call(node.name, [])
        if isinstance(node, Pipe):
            return self.pipe(node, dot)
        if isinstance(node, Field):
            value = dot if node.receiver is None else self.operand(node.receiver, dot)
            for name in node.names:
                value = _field(value, name)
            return value
        raise GoTemplateError(f"template: cannot evaluate {node!r}")


def _may_break(nodes: list) -> bool:
    """Whether a range body holds a {{break}} of its own (one in a nested range ends that range only)."""
    for node in nodes:
        if isinstance(node, Loop) and node.kind == "break":
            return True
        if isinstance(node, Branch) and node.kind != "range" and \
                (_may_break(node.body) or _may_break(node.otherwise or [])):
            return True
    return False


def _field(value: Any, name: str) -> Any:
    if isinstance(value, GoStruct):
        if name not in value:
            raise GoTemplateError(f"template: can't evaluate field {name}")
        return value[name]
    if isinstance(value, dict):
        return value.get(name)  # a map: a missing key is nil (missingkey=zero)
    if value is None:
        raise GoTemplateError(f"template: nil has no field {name}")
    raise GoTemplateError(f"template: can't evaluate field {name} in {_text(value)[:40]!r}")

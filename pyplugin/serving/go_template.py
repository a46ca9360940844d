"""Ollama's `template` request field: the part of Go's text/template that prompt templates use."""

from __future__ import annotations

import re
from typing import Mapping

from ..errors import OptionsError

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
TEMPLATE_HELP = ("{{ .System }}, {{ .Prompt }}, {{ .Response }}, {{ if .X }}...{{ else }}...{{ end }} "
                 "and the '-' trim markers")


def render_go_template(template: str, values: Mapping[str, str]) -> str:
    """Render a Go text/template that uses only variables and if/else/end on them.

    Anything else (range, functions, pipelines) is refused with a message, rather than rendered
    wrongly: a prompt that silently differs from what the template meant is worse than an error.
    """
    tokens: list[tuple[str, str]] = []  # ("text", s) or ("action", body)
    pos = 0
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        if tokens and tokens[-1][0] == "trim_next":
            tokens.pop()
            text = text.lstrip()
        tokens.append(("text", text))
        tokens.append(("action", m.group(2)))
        if m.group(3):
            tokens.append(("trim_next", ""))
        pos = m.end()
    rest = template[pos:]
    if tokens and tokens[-1][0] == "trim_next":
        tokens.pop()
        rest = rest.lstrip()
    tokens.append(("text", rest))

    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (this branch is taken, the enclosing output is on)

    def on() -> bool:  # each entry's `outer` already folds in the ones below it
        return not stack or (stack[-1][0] and stack[-1][1])

    for kind, body in tokens:
        if kind == "text":
            if on():
                out.append(body)
            continue
        if body.startswith("/*"):
            continue  # a comment
        var = re.fullmatch(r"\.(\w+)", body)
        cond = re.fullmatch(r"if\s+\.(\w+)", body)
        if var:
            if on():
                out.append(_template_value(values, var.group(1)))
        elif cond:
            stack.append((bool(_template_value(values, cond.group(1))), on()))
        elif body == "else" and stack:
            taken, outer = stack.pop()
            stack.append((not taken, outer))
        elif body == "end" and stack:
            stack.pop()
        else:
            raise OptionsError(f"template: {{{{ {body} }}}} is not supported; supported: {TEMPLATE_HELP}")
    if stack:
        raise OptionsError("template: an {{ if }} has no {{ end }}")
    return "".join(out)


def _template_value(values: Mapping[str, str], name: str) -> str:
    if name not in values:
        raise OptionsError(f"template: .{name} is not a field; fields: "
                           f"{', '.join('.' + k for k in values)}")
    return values[name]

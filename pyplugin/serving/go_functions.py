"""The values a Go template computes with, and its functions: Go's builtins and Ollama's `json`."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from ..errors import OptionsError
from ..model.chat import MAX_OUTPUT

MAX_TEXT = MAX_OUTPUT  # the longest text one function may return: what a whole rendering may write


class GoTemplateError(OptionsError):
    """The template failed while it ran (a missing field, a wrong argument, a limit)."""


class GoStruct(dict):
    """A Go struct: fields by Go name; `text` is what printing it writes (Ollama's String methods)."""

    def __init__(self, fields: Mapping[str, Any], text: str | None = None):
        super().__init__(fields)
        self.text = text


class GoMap(dict):
    """A Go map[string]any (the template's own data: a missing key is nil, not an error)."""


def go_json(value: Any) -> str:
    """encoding/json's Marshal: compact, map keys sorted, <, > and & escaped as Go escapes them."""
    text = json.dumps(_plain(value), ensure_ascii=False, separators=(",", ":"), sort_keys=False)
    for c, e in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(c, e)
    return text


class GoFields(dict):
    """A struct's JSON: its fields in their declared order (a map's keys are sorted instead)."""


def _plain(value: Any) -> Any:
    if isinstance(value, GoStruct):
        return _plain(value.json) if hasattr(value, "json") else {k: _plain(v) for k, v in value.items()}
    if isinstance(value, GoFields):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, dict):
        return {k: _plain(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def truth(value: Any) -> bool:
    if isinstance(value, GoStruct):
        return True
    return bool(value)


def text(value: Any) -> str:
    """fmt's %v of a value."""
    if isinstance(value, GoStruct):
        return value.text if value.text is not None else "{" + " ".join(text(v) for v in value.values()) + "}"
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return "NaN" if value != value else "+Inf" if value > 0 else "-Inf"  # as Go prints them
        return repr(value) if value != int(value) or abs(value) >= 1e21 else str(int(value))
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{text(value[k])}" for k in sorted(value)) + "]"
    return str(value)




# -- functions ----------------------------------------------------------------------------------------------

def call(name: str, args: list) -> Any:
    function = FUNCTIONS.get(name)
    if function is None:
        raise GoTemplateError(f"template: function {name!r} is not defined; functions: {', '.join(sorted(FUNCTIONS))}")
    try:
        value = function(*args)
    except TypeError:
        raise GoTemplateError(f"template: wrong number of arguments for {name}: {len(args)}") from None
    except GoTemplateError:
        raise
    except (ValueError, OverflowError) as exc:  # chr of a huge number, a float past int's range...
        raise GoTemplateError(f"template: {name}: {exc}") from None
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise GoTemplateError(f"template: {name} made a text of {len(value)} characters, more than a rendering "
                              f"may write ({MAX_TEXT}); it was stopped")
    return value


def _len(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())  # Go counts bytes
    if isinstance(value, (list, tuple, dict)):
        return len(value)
    raise GoTemplateError(f"template: len of {text(value)[:40]!r}")


def _index(value: Any, *keys: Any) -> Any:
    for key in keys:
        try:
            value = value.get(key) if isinstance(value, dict) and not isinstance(value, GoStruct) else value[key]
        except (IndexError, KeyError, TypeError):
            raise GoTemplateError(f"template: index {text(key)} out of range or not found") from None
    return value


def _slice(value: Any, *bounds: int) -> Any:
    if len(bounds) > 2:
        raise GoTemplateError("template: slice takes at most two indexes for a list or string")
    data = value.encode() if isinstance(value, str) else value
    if not isinstance(data, (bytes, list, tuple)):
        raise GoTemplateError(f"template: can't slice {text(value)[:40]!r}")
    low, high = (list(bounds) + [0, len(data)][len(bounds):])[:2]
    if not 0 <= low <= high <= len(data):
        raise GoTemplateError(f"template: slice [{low}:{high}] out of range of {len(data)}")
    part = data[low:high]
    return part.decode(errors="replace") if isinstance(value, str) else list(part)


def _comparable(a: Any, b: Any) -> bool:
    number = (int, float)
    return (isinstance(a, bool) == isinstance(b, bool)) and (
        type(a) is type(b) or isinstance(a, number) and isinstance(b, number) or a is None or b is None)


def _eq(a: Any, *others: Any) -> bool:
    if not others:
        raise GoTemplateError("template: eq needs at least two arguments")
    return any(_comparable(a, b) and a == b for b in others)


def _order(op: Callable[[Any, Any], bool], name: str) -> Callable[[Any, Any], bool]:
    def compare(a: Any, b: Any) -> bool:
        if not (isinstance(a, str) and isinstance(b, str) or
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))):
            raise GoTemplateError(f"template: {name}: incompatible types for comparison")
        return op(a, b)
    return compare


def _fmt(value: Any) -> str:
    """fmt's %v (which writes nil as <nil>; the template's own printing writes <no value>)."""
    return "<nil>" if value is None else text(value)


def _sprint(*args: Any) -> str:
    out = []
    for i, a in enumerate(args):  # a space between operands when neither is a string
        if i and not isinstance(a, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append(_fmt(a))
    return "".join(out)


_VERB = re.compile(r"%([-+# 0]*)(\d*)(?:\.(\d+))?([vsdqtfgxXeEc%])")


def _sprintf(form: str, *args: Any) -> str:
    values = iter(args)

    def one(m: re.Match) -> str:
        flags, width, precision, verb = m.groups()
        if len(width) > 7 or len(precision or "") > 7:  # a width such as %0999999999d would be built first
            raise GoTemplateError(f"template: printf {m.group()!r}: width and precision go up to 9999999")
        if verb == "%":
            return "%"
        value = next(values, None)
        if verb in "vs":
            out = _fmt(value)
        elif verb == "q":
            out = json.dumps(value if isinstance(value, str) else text(value), ensure_ascii=False)
        elif verb == "t":
            out = text(bool(value))
        elif verb == "c":
            out = chr(value)
        else:
            spec = f"{flags}{width}{'.' + precision if precision else ''}{verb}"
            try:
                return ("%" + spec) % value
            except (TypeError, ValueError):
                return f"%!{verb}({text(value)})"
        return out.rjust(int(width)) if width and "-" not in flags else out.ljust(int(width or 0))
    return _VERB.sub(one, form)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "and": lambda *a: a[-1], "or": lambda *a: a[-1],  # short-circuited by the executor
    "not": lambda a: not truth(a),
    "len": _len, "index": _index, "slice": _slice,
    "eq": _eq, "ne": lambda a, b: not _eq(a, b),
    "lt": _order(lambda a, b: a < b, "lt"), "le": _order(lambda a, b: a <= b, "le"),
    "gt": _order(lambda a, b: a > b, "gt"), "ge": _order(lambda a, b: a >= b, "ge"),
    "print": _sprint, "println": lambda *a: " ".join(map(_fmt, a)) + "\n", "printf": _sprintf,
    "json": go_json,
}

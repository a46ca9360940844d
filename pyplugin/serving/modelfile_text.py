"""A Modelfile's text, read and written as Ollama reads and writes it, so that what `pebbling show
--modelfile` prints, `pebbling create -f` makes into the same model again.

The syntax (Ollama's parser/parser.go): one instruction per line, its name in any case, then its value;
`#` starts a comment line. ``FROM`` names a GGUF file, a blob (``sha256:<hex>``) or a model;
``PARAMETER NAME VALUE`` (repeatable; each ``stop`` adds a stop string); ``TEMPLATE`` (a Go template),
``SYSTEM`` and ``LICENSE`` (repeatable); ``MESSAGE ROLE TEXT`` (repeatable). A value is the rest of its
line, or a string in ``"..."`` or ``\"\"\"...\"\"\"`` that may span lines and ends at the first line end
where its quotes close; quotes have no escapes. ``ADAPTER`` and Ollama's ``DRAFT``, ``RENDERER``,
``PARSER`` and ``REQUIRES`` are refused by name: pebbling does not serve what they ask for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import PebblingError

ROLES = ("system", "user", "assistant", "tool")
INSTRUCTIONS = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "MESSAGE", "LICENSE")
REFUSED = {
    "adapter": "ADAPTER (a LoRA adapter) is not supported: pebbling serves a GGUF as it is; merge the adapter "
               "into the model first (llama.cpp's llama-export-lora) and create FROM the merged file",
    "draft": "DRAFT (a draft model for speculative decoding) is not supported by pebbling",
    "renderer": "RENDERER (Ollama's built-in prompt renderers) is not supported by pebbling: give a TEMPLATE",
    "parser": "PARSER (Ollama's built-in output parsers) is not supported by pebbling",
    "requires": "REQUIRES (a minimum Ollama version) is not supported by pebbling",
}

# PARAMETER values are text; each becomes the type its option takes, as Ollama's FormatParams makes it.
_INTEGER = frozenset({"num_ctx", "num_batch", "num_keep", "num_predict", "seed", "top_k", "repeat_last_n",
                      "num_gpu", "main_gpu", "num_thread", "num_gqa", "mirostat", "pebbling_expert_cache"})
_NUMBER = frozenset({"temperature", "top_p", "min_p", "typical_p", "tfs_z", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "mirostat_tau", "mirostat_eta", "rope_frequency_base",
                     "rope_frequency_scale"})
_BOOLEAN = frozenset({"use_mmap", "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all",
                      "embedding_only", "penalize_newline", "pebbling_enabled", "pebbling_cache_prompt",
                      "pebbling_expert_prefetch"})
_TEXT = frozenset({"pebbling_strategy", "pebbling_weights", "pebbling_kv_type", "pebbling_expert_policy"})
_SIZE = frozenset({"pebbling_memory_limit"})  # bytes, or a string such as 6GiB
_LIST = frozenset({"stop"})
PARAMETERS = _INTEGER | _NUMBER | _BOOLEAN | _TEXT | _SIZE | _LIST
_TRUE, _FALSE = ("1", "t", "T", "TRUE", "true", "True"), ("0", "f", "F", "FALSE", "false", "False")  # Go's

_WORD = re.compile(r"[^\s]*")
_SPACE = re.compile(r"[ \t]+")
_KEY = re.compile(r"([A-Za-z0-9_]+)[ \t]+")


class ModelfileError(PebblingError):
    """A Modelfile pebbling cannot read or will not take: the line, what was wrong, what would do."""


@dataclass
class Modelfile:
    """What a Modelfile asks for, as /api/create's fields (FROM still as written)."""

    from_: str
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    licenses: list[str] = field(default_factory=list)


def parse(text: str) -> Modelfile:
    """The Modelfile `text` (ModelfileError naming the line where it is wrong)."""
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    found: dict[str, Any] = {"parameters": {}, "messages": [], "licenses": []}
    froms: list[str] = []
    at = 0
    while at < len(text):
        if text[at] in " \t\n":
            at += 1
            continue
        if text[at] == "#":
            end = text.find("\n", at)
            at = len(text) if end < 0 else end
            continue
        line = text.count("\n", 0, at) + 1
        word = _WORD.match(text, at).group(0)
        name = word.lower()
        if name in REFUSED:
            raise ModelfileError(f"line {line}: {REFUSED[name]}")
        if name.upper() not in INSTRUCTIONS:
            raise ModelfileError(f"line {line}: {word[:40]!r} is not an instruction; a Modelfile's lines start "
                                 f"with {', '.join(INSTRUCTIONS)} (or # for a comment)")
        at += len(word)
        if not _SPACE.match(text, at):
            raise ModelfileError(f"line {line}: {name.upper()} needs a value after it, on the same line")
        at = _SPACE.match(text, at).end()
        key = None
        if name in ("parameter", "message"):
            given = _KEY.match(text, at)
            if not given:
                what = "PARAMETER NAME VALUE" if name == "parameter" else "MESSAGE ROLE TEXT"
                raise ModelfileError(f"line {line}: {name.upper()} needs a name and a value: {what}")
            key, at = given.group(1), given.end()
        value, at = read_value(text, at, line)
        if name == "from":
            froms.append(value)
        elif name == "parameter":
            _add_parameter(found["parameters"], key, value, line)
        elif name == "message":
            if key not in ROLES:
                raise ModelfileError(f"line {line}: MESSAGE role {key!r}: accepted: {', '.join(ROLES)}")
            found["messages"].append({"role": key, "content": value})
        elif name == "license":
            found["licenses"].append(value)
        else:
            found[name] = value
    if len(froms) != 1:
        raise ModelfileError("a Modelfile needs one FROM line (a GGUF file, a blob sha256:<hex> or a model), "
                             f"this one has {len(froms)}")
    if not froms[0]:
        raise ModelfileError("FROM needs a value: a GGUF file, a blob sha256:<hex> or a model's name")
    return Modelfile(froms[0], **found)


def read_value(text: str, start: int, line: int = 0) -> tuple[str, int]:
    """The value that starts at `start` and where it ends: the rest of the line, or a quoted string that
    ends at the first line end where its quotes close, as Ollama's parser reads it."""
    at = start
    while True:
        newline = text.find("\n", at)
        end = len(text) if newline < 0 else newline
        closed, value = _unquote(text[start:end].strip(" \t\n"))
        if closed:
            return value, end
        if newline < 0:
            raise ModelfileError(f"line {line}: a quoted value that is never closed (a \"\"\" or \" without its end)")
        at = newline + 1


def _unquote(text: str) -> tuple[bool, str]:
    if text.startswith('"""'):
        return (True, text[3:-3]) if len(text) >= 6 and text.endswith('"""') else (False, "")
    if text.startswith('"'):
        return (True, text[1:-1]) if len(text) >= 2 and text.endswith('"') else (False, "")
    return True, text


def _add_parameter(parameters: dict[str, Any], key: str, text: str, line: int) -> None:
    if key not in PARAMETERS:
        raise ModelfileError(f"line {line}: PARAMETER {key!r} is not a parameter pebbling knows; parameters: "
                             f"{', '.join(sorted(PARAMETERS))}")
    try:
        value = parameter_value(key, text)
    except ValueError:
        kind = ("an integer" if key in _INTEGER else "a number" if key in _NUMBER else "true or false")
        raise ModelfileError(f"line {line}: PARAMETER {key} {text!r}: accepted: {kind}") from None
    if key in _LIST:
        parameters.setdefault(key, []).append(value)
    else:
        parameters[key] = value


def parameter_value(key: str, text: str) -> Any:
    """A PARAMETER's text as the type its option takes (ValueError where it cannot be)."""
    if key in _INTEGER:
        return int(text)
    if key in _NUMBER:
        return float(text)
    if key in _BOOLEAN:
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(text)
    if key in _SIZE and text.isascii() and text.isdigit():
        return int(text)
    return text


# ---------------------------------------------------------------------------------------------------
# writing


def quoted(text: str, prefer: str = '"""') -> str | None:
    """`text` as a value that reads back as `text`: in `prefer` quotes where they can hold it, else in the
    other ones; None where neither can (a line inside ends with the closing quotes)."""
    for quote in dict.fromkeys((prefer, '"""', '"')):
        candidate = f"{quote}{text}{quote}"
        try:
            if read_value(candidate + "\n", 0) == (text, len(candidate)):
                return candidate
        except ModelfileError:
            pass
    return None


def format_modelfile(name: str, from_: str, *, template: str | None, system: str | None,
                     parameters: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], license: str) -> str:
    """The Modelfile of a model, as `ollama show --modelfile` prints one: FROM what it was made from (its
    blob, or a file's model name), its model name in a comment, then its layers."""
    lines = ['# Modelfile generated by "pebbling show"', "# To build a new Modelfile based on this, replace FROM with:",
             f"# FROM {name}", "", f"FROM {from_}"]

    def add(instruction: str, text: str, prefer: str = '"""') -> None:
        value = quoted(text, prefer)
        lines.append(f"{instruction}{value}" if value is not None else
                     f"# {instruction.split()[0]} left out: a line of its text ends in quotes a Modelfile cannot hold")

    if template is not None:
        add("TEMPLATE ", template)
    if system is not None:
        add("SYSTEM ", system)
    for key, value in parameters.items():
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, str):
                add(f"PARAMETER {key:<15} ", one, '"')
            else:
                lines.append(f"PARAMETER {key:<15} {_plain(one)}")
    for message in messages:
        add(f"MESSAGE {message.get('role', '')} ", str(message.get("content", "")), '"')
    if license:
        add("LICENSE ", license)
    return "\n".join(lines) + "\n"


def _plain(value: Any) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)

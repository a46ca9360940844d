"""The chat of `pebbling run MODEL` without a prompt, with `ollama run`'s commands: /set parameter,
/set system, /show, /clear, /bye, /? and multi-line input between triple quotes. Lines are read with
prompt_toolkit (history, editing) on a terminal, plainly otherwise (TERM=dumb, or stdout not a terminal).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

from ..errors import OptionsError, PebblingError
from ..runtime import Options, PebblingOptions

HELP = """\
Available commands:
  /set parameter NAME VALUE   set an option for the next turns (num_predict 8, temperature 0, stop TEXT...)
  /set system TEXT            set the system message
  /set verbose | quiet        print timings after each answer, or not
  /set format json | /set noformat
  /set think [low|medium|high] | /set nothink   thinking on (gpt-oss: its effort), or off
  /show info | license | modelfile | parameters | system | template
  /clear                      forget the conversation so far
  /bye                        exit (so does Ctrl-D)
  /?, /help                   this help

Use \"\"\" to begin a multi-line message, and \"\"\" again to end it."""

SHOW_TOPICS = ("info", "license", "modelfile", "parameters", "system", "template")


def chat(session) -> int:
    """Reads turns until /bye or end of input; 0 on a normal exit."""
    read = _reader()
    while True:
        try:
            text = _message(read)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("Use Ctrl + d or /bye to exit.")
            continue
        if not text.strip():
            continue
        if text.startswith("/"):
            if command(session, text.strip()) == "bye":
                return 0
            continue
        try:
            session.answer(text)
            print()  # a blank line between an answer and the next prompt, as ollama leaves
        except KeyboardInterrupt:  # stops this answer; the chat goes on
            print()
        except PebblingError as exc:
            print(f"pebbling: error: {exc}", file=sys.stderr)


def _reader() -> Callable[[str], str]:
    """A function that reads one line after showing a prompt; EOFError at the end of input."""
    if sys.stdin.isatty() and sys.stdout.isatty() and os.environ.get("TERM") != "dumb":
        from prompt_toolkit import PromptSession

        prompt_session = PromptSession()
        return lambda prompt: prompt_session.prompt(prompt, placeholder=_placeholder(prompt))

    def plain(prompt: str) -> str:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")
    return plain


def _placeholder(prompt: str):
    from prompt_toolkit.formatted_text import FormattedText

    return FormattedText([("#888888", "Send a message (/? for help)")]) if prompt == ">>> " else ""


def _message(read: Callable[[str], str]) -> str:
    """One message: a line, or the lines from an opening \"\"\" to the closing one, as Ollama reads them."""
    line = read(">>> ")
    if not line.lstrip().startswith('"""'):
        return line
    first = line.lstrip()[3:]
    if first.endswith('"""'):  # """all on one line"""
        return first[:-3]
    lines = [first] if first else []
    while True:
        line = read("... ")
        if line.endswith('"""'):
            lines.append(line[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def command(session, text: str) -> str | None:
    """Carries out one /command; "bye" to end the chat."""
    words = text.split(maxsplit=1)
    name, rest = words[0], words[1] if len(words) > 1 else ""
    if name in ("/bye", "/exit"):
        return "bye"
    if name in ("/?", "/help"):
        print(HELP)
    elif name == "/clear":
        session.messages.clear()
        print("Cleared session context")
    elif name == "/set":
        _set(session, rest)
    elif name == "/show":
        _show(session, rest.strip())
    else:
        print(f"Unknown command '{name}'. Type /? for help")
    return None


def _set(session, rest: str) -> None:
    what, _, value = rest.partition(" ")
    value = value.strip()
    if what == "parameter":
        name, _, raw = value.partition(" ")
        raw = raw.strip()
        if not name or not raw:
            print("Usage: /set parameter NAME VALUE (e.g. /set parameter num_predict 8)")
            return
        try:
            set_parameter(session.options, name, raw)
        except PebblingError as exc:
            print(f"pebbling: error: {exc}", file=sys.stderr)
            return
        print(f"Set parameter '{name}' to '{raw}'")
    elif what == "system":
        if not value:
            print("Usage: /set system TEXT")
            return
        session.system = value.strip('"')
        print("Set system message.")
    elif what in ("verbose", "quiet"):
        session.verbose = what == "verbose"
        print(f"Set '{what}' mode.")
    elif what == "format" and value == "json":
        session.format = "json"
        print("Set format to 'json' mode.")
    elif what == "noformat":
        session.format = None
        print("Disabled format.")
    elif what == "think" and value in ("", "low", "medium", "high"):
        session.think = value or True
        print(f"Set 'think' mode{f' to {value!r}' if value else ''}.")
    elif what == "nothink":
        session.think = False
        print("Set 'nothink' mode.")
    else:
        print(f"Unknown /set '{rest}'. Type /? for help")


def set_parameter(options: dict, name: str, raw: str) -> None:
    """`options[name]` from the text typed, checked as the server will check it; `stop` adds a string."""
    value: object = raw
    if name == "stop":
        value = [*options.get("stop", []), raw]
    elif raw in ("true", "false"):
        value = raw == "true"
    else:
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                continue
    candidate = {**options, name: value}
    try:
        Options.from_dict(candidate)
        PebblingOptions.from_options(candidate)
    except OptionsError as exc:
        raise PebblingError(str(exc)) from None
    options[name] = value


def _show(session, topic: str) -> None:
    if topic not in SHOW_TOPICS:
        print(f"Usage: /show {' | '.join(SHOW_TOPICS)}")
        return
    try:
        info = session.backend.show(session.model)
    except PebblingError as exc:
        print(f"pebbling: error: {exc}", file=sys.stderr)
        return
    if topic == "info":
        print(format_info(info))
    elif topic == "parameters":
        print(info.get("parameters") or "No parameters in the model.")
        if session.options:
            print("User defined parameters:")
            for name, value in session.options.items():
                print(f"  {name:<24}{json.dumps(value)}")
    elif topic == "system":
        print(session.system or info.get("system") or "No system message was specified for this model.")
    else:
        print(info.get(topic) or f"No {topic} was specified for this model.")


def format_info(info: dict) -> str:
    """What `ollama show` prints first: architecture, parameters, context length, quantization."""
    details, model_info = info.get("details", {}), info.get("model_info", {})
    arch = details.get("family") or model_info.get("general.architecture", "")
    rows = [("architecture", arch), ("parameters", details.get("parameter_size", "")),
            ("context length", model_info.get(f"{arch}.context_length", "")),
            ("embedding length", model_info.get(f"{arch}.embedding_length", "")),
            ("quantization", details.get("quantization_level", ""))]
    lines = ["  Model"] + [f"    {name:<20}{value}" for name, value in rows if value != ""]
    capabilities = info.get("capabilities") or []
    if capabilities:
        lines += ["", "  Capabilities"] + [f"    {c}" for c in capabilities]
    for key, title in (("parameters", "Parameters"), ("system", "System"), ("license", "License")):
        text = (info.get(key) or "").strip()
        if text:
            lines += ["", f"  {title}"] + [f"    {line}" for line in text.splitlines()[:8]]
    return "\n".join(lines)

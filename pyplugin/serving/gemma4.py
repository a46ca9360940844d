"""Gemma 4's replies: its thinking in a channel, ``<|channel>thought\\n...<channel|>``, then its answer, and its tool
calls as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, the arguments in Gemma 4's notation (keys bare,
strings between ``<|"|>``, numbers, true, false, null, lists in [], objects in {}).

The tokenizer shows these markers in the text (model/tokenizer_gemma4.py: Gemma 4's converter marks them so, as
llama.cpp's chat parser reads them), so the parser reads the text as it streams: thinking and content go out as
they come (what may begin a marker held back), a call when it closes. The thinking is split out whatever `think`
says, as gpt-oss's is (serving/harmony.py): with thinking off the template writes an empty thought, and a stray
thought must not reach the content with its markers. Calls are read only where the request offered tools;
elsewhere the text stays as written.
"""

from __future__ import annotations

import re
from typing import Any

from .tool_calls import ToolCall, held_back, is_gemma4  # noqa: F401 (is_gemma4: for reply.py)

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
THOUGHT = "thought"


class Gemma4Parser:
    """Splits a Gemma 4 reply into thinking, content and tool calls as it streams: `feed(text)` and at the end
    `finish()`, each giving the (thinking, content, calls) of what came in since. `tools`: whether calls are read."""

    def __init__(self, tools: bool = False):
        self._markers = (CHANNEL_OPEN, CHANNEL_CLOSE) + ((CALL_OPEN,) if tools else ())
        self._pending = ""
        self._state = "content"        # content -> channel (-> content) ... ; content -> call (-> content)
        self._channel_start = False    # the channel's name ("thought") and the whitespace after it not read yet

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        self._pending += text
        thinking: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._pending:
            if self._state == "content":
                if not self._content(content, final):
                    break
            elif self._state == "channel":
                if not self._channel(thinking, final):
                    break
            elif not self._call(content, calls, final):
                break
        return "".join(thinking), "".join(content), calls

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        return self.feed("", final=True)

    # -- the states: each takes what it can of the pending text, and says whether to go on

    def _content(self, content: list[str], final: bool) -> bool:
        found = [(at, m) for m in self._markers if (at := self._pending.find(m)) >= 0]
        if not found:
            keep = 0 if final else max(held_back(self._pending, m) for m in self._markers)
            content.append(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        at, marker = min(found)
        content.append(self._pending[:at])
        self._pending = self._pending[at + len(marker):]
        if marker == CHANNEL_OPEN:
            self._state, self._channel_start = "channel", True
        elif marker == CALL_OPEN:
            self._state = "call"
        # (a closing <channel|> with no channel open: dropped, as llama.cpp's parser stops at it)
        return True

    def _channel(self, thinking: list[str], final: bool) -> bool:
        if self._channel_start:  # the channel's name, "thought", and the whitespace after it are not thinking
            head = self._pending.lstrip()
            if not final and CHANNEL_CLOSE not in head and (THOUGHT.startswith(head) or (
                    head.startswith(THOUGHT) and not head[len(THOUGHT):].strip())):
                return False  # not known yet
            self._pending = head.removeprefix(THOUGHT).lstrip()
            self._channel_start = False
        at = self._pending.find(CHANNEL_CLOSE)
        if at >= 0:
            thinking.append(self._pending[:at].rstrip())
            self._pending, self._state = self._pending[at + len(CHANNEL_CLOSE):], "content"
            return True
        if final:
            thinking.append(self._pending.rstrip())
            self._pending = ""
            return False
        # kept back: what may begin the closing marker, and the whitespace that may end the thinking
        body = self._pending[:len(self._pending) - held_back(self._pending, CHANNEL_CLOSE)].rstrip()
        thinking.append(body)
        self._pending = self._pending[len(body):]
        return False

    def _call(self, content: list[str], calls: list[ToolCall], final: bool) -> bool:
        at = self._pending.find(CALL_CLOSE)
        if at < 0 and not final:
            return False
        body = self._pending if at < 0 else self._pending[:at]
        self._pending = "" if at < 0 else self._pending[at + len(CALL_CLOSE):]
        self._state = "content"
        call = parse_call(body)
        if call is None:  # not a call after all: the text as the model wrote it
            content.append(CALL_OPEN + body + ("" if at < 0 else CALL_CLOSE))
        else:
            calls.append(call)
        return True


# ---------------------------------------------------------------------------------------------------
# Gemma 4's notation for arguments

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}


def parse_call(body: str) -> ToolCall | None:
    """The call in `body` ("call:NAME{...}", what is between the call's markers), or None if it is not one."""
    found = re.match(r"\s*call:([^{\s]+)\s*", body)
    if not found:
        return None
    try:
        arguments, end = _value(body, found.end())
    except ValueError:
        return None
    if not isinstance(arguments, dict) or body[end:].strip():
        return None
    return ToolCall(found.group(1), arguments)


def parse_arguments(text: str) -> Any:
    """A value written in Gemma 4's notation, as JSON would hold it; ValueError if it is not one."""
    value, end = _value(text, 0)
    if text[end:].strip():
        raise ValueError(f"text after the value: {text[end:end + 20]!r}")
    return value


def _value(text: str, at: int) -> tuple[Any, int]:
    at = _skip(text, at)
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError("a string is not closed")
        return text[at + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", at):
        out: dict[str, Any] = {}

        def entry(at: int) -> int:
            colon = text.find(":", at)
            key = text[at:colon] if colon >= 0 else ""
            if not key or "}" in key or "," in key:
                raise ValueError(f"no key at {at}")
            if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
                key = key[len(QUOTE):-len(QUOTE)]
            out[key.strip()], at = _value(text, colon + 1)
            return at
        return out, _items(text, at, "}", entry)
    if text.startswith("[", at):
        items: list[Any] = []

        def item(at: int) -> int:
            value, at = _value(text, at)
            items.append(value)
            return at
        return items, _items(text, at, "]", item)
    number = _NUMBER.match(text, at)
    if number:
        digits = number.group()
        return (float(digits) if any(c in digits for c in ".eE") else int(digits)), number.end()
    for word, value in _WORDS.items():
        if text.startswith(word, at):
            return value, at + len(word)
    raise ValueError(f"no value at {at}")


def _items(text: str, at: int, close: str, read) -> int:
    """Reads the comma-separated items of an object or a list opening at `at` (each by `read`, which returns where
    it ends) up to `close`; where the text goes on after it."""
    at = _skip(text, at + 1)
    while not text.startswith(close, at):
        at = _skip(text, read(at))
        if text.startswith(",", at):
            at = _skip(text, at + 1)
        elif not text.startswith(close, at):
            raise ValueError(f"expected ',' or '{close}' at {at}")
    return at + 1


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at

"""gpt-oss's chat format (OpenAI's harmony): a reply is a run of messages, each a header then a body,
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``, a tool
call one on the commentary channel addressed to the function (``<|channel|>commentary to=functions.add
<|constrain|>json<|message|>{"a": 2}<|call|>``, the address before the channel as well). The analysis channel
is the model's thinking, the final channel its answer; a commentary message to a function is a call, one
without an address a preamble shown as content.

The tokenizer shows the header tokens in the text and hides <|end|> (model.tokenizer: as llama.cpp does), so
the parser reads the text as it streams: a header is held until its <|message|>, a body goes out as it comes
(what may begin the next <|start|> held back), a call's arguments are parsed when its message ends. Ollama
splits gpt-oss's thinking out whatever `think` says, and so does this; the template takes `think`'s level
("low", "medium", "high") as its reasoning_effort.
"""

from __future__ import annotations

import json
import re

from .tool_calls import CutCall, ToolCall, held_back, is_harmony  # noqa: F401 (is_harmony: for reply.py)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
THINK_LEVELS = ("low", "medium", "high")   # `think`'s levels, the harmony template's reasoning_effort
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_HEADERS = (CHANNEL, START, "assistant", "<|constrain|>")  # what a reply's first message may open with


class HarmonyParser:
    """Splits a harmony reply into thinking, content and tool calls as it streams: `feed(text)` and at the
    end `finish()`, each giving the (thinking, content, calls) of what came in since."""

    def __init__(self) -> None:
        self._pending = ""
        self._state = "header"          # header -> body -> header ... ; "plain": the model wrote no harmony
        self._channel, self._recipient, self._call = "", None, ""
        self.cut: CutCall | None = None  # a call whose arguments are not JSON: the token limit cut it

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        self._pending += text
        thinking, content, calls = [], [], []
        while True:
            if self._state == "plain":
                content.append(self._pending)
                self._pending = ""
                break
            if self._state == "header":
                at = self._pending.find(MESSAGE)
                if at < 0:
                    if not final and self._may_open(self._pending):
                        break
                    if not self._channel:  # the reply opened with no header: the model wrote no harmony
                        self._state = "plain"
                        continue
                    if final:              # a header the token limit cut: neither thinking nor content
                        self._pending = ""
                        break
                    self._open("")         # text where a header belongs: shown as an answer
                    self._state = "body"
                    continue
                self._open(self._pending[:at])
                self._pending, self._state = self._pending[at + len(MESSAGE):], "body"
            at = self._pending.find(START)
            body = self._pending if at < 0 else self._pending[:at]
            if at < 0 and not final:
                body = body[:len(body) - held_back(body, START)]
            self._pending = self._pending[len(body):]
            self._route(body, thinking, content)
            if at < 0 and not final:
                break
            calls += self._close()
            if at < 0:
                break
            self._pending, self._state = self._pending[len(START):], "header"
        return "".join(thinking), "".join(content), calls

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        return self.feed("", final=True)

    # -- one message

    def _may_open(self, text: str) -> bool:
        """Whether `text` may still become a header: it starts (after "assistant", spaces) with a header token,
        or is the beginning of one."""
        text = text.lstrip()
        return not text or any(text.startswith(h) or h.startswith(text) for h in _HEADERS) or "<|" in text

    def _open(self, header: str) -> None:
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self._channel = re.split(r"\s|<\|", channel.strip(), maxsplit=1)[0] if channel.strip() else "final"
        found = _RECIPIENT.search(header)
        self._recipient = found.group(1) if found else None
        self._call = ""

    def _route(self, body: str, thinking: list[str], content: list[str]) -> None:
        if self._recipient:
            self._call += body
        elif self._channel == "analysis":
            thinking.append(body)
        else:
            content.append(body)

    def _close(self) -> list[ToolCall]:
        """The message ends: a call's arguments parsed. Arguments that are not a JSON object (a harmony call's
        are, <|constrain|>json) are the call the token limit cut: kept as `cut`, never a call to make."""
        recipient, text = self._recipient, self._call.strip()
        self._recipient, self._call = None, ""
        if not recipient:
            return []
        name = recipient.removeprefix("functions.")
        try:
            arguments = json.loads(text) if text else {}
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            self.cut = CutCall(name, text)
            return []
        return [ToolCall(name, arguments)]

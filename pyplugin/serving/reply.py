"""The assistant's reply beyond plain text: thinking and tool calls.

`ReplyPlan.of(request, template)` checks what a chat request asks for against what the model's template
supports (tools, `think`, `tool_choice`), says what to pass the template, and makes the parser that splits
the generated text into content, thinking and calls as it streams.

Thinking follows the convention the templates of reasoning models share (Qwen3, DeepSeek-R1...): the reply
opens with ``<think>``, reasons, closes with ``</think>``, then answers. ``think: true`` turns it on and
splits it out; ``think: false`` turns it off as Ollama does, through the template's ``enable_thinking``
where it has one, else with an empty think block after the prompt; no ``think``: the template's default,
the text left as the model wrote it. `think` may be a level, "low", "medium" or "high": on for a thinking
model, and the reasoning effort of a harmony one (gpt-oss, serving/harmony.py), whose thinking is always its
analysis channel, split out whatever `think` says, as Ollama does. Gemma 4 (serving/gemma4.py) thinks in a channel
of its own, split out likewise; `think` reaches its template as enable_thinking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import OptionsError
from .gemma4 import Gemma4Parser, is_gemma4
from .harmony import THINK_LEVELS, HarmonyParser, is_harmony
from .jobs import GenerationRequest
from .tool_calls import (CutCall, ToolCall, ToolCallParser, ToolFormat, call_grammar, check_tools, forced_tools,
                         held_back, tool_format)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINKING = "<think>\n\n</think>\n\n"


def thinks(template: str | None) -> bool:
    """Whether a model with this template marks a reasoning part: it writes the tags, or strips the reasoning
    of earlier replies at their closing tag (QwQ's and DeepSeek-R1's do only that), or it writes harmony (gpt-oss's
    analysis channel) or Gemma 4's (its thought channel)."""
    return bool(template) and (THINK_OPEN in template or THINK_CLOSE in template or is_harmony(template)
                               or is_gemma4(template))


@dataclass
class Output:
    """What a piece of generated text turned out to be."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None  # of the tokens behind it, when the request asked
    cut_call: CutCall | None = None  # at the end: the forced call the token limit cut short, if it did

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls or self.cut_call)


class ThinkingParser:
    """Splits ``<think>...</think>`` off the start of the reply as it streams. `inside`: the prompt
    already opened the block (DeepSeek-R1's templates end it with ``<think>``)."""

    def __init__(self, inside: bool = False):
        self._state = "opened" if inside else "start"  # start -> opened -> thinking -> after -> content
        self._pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking, content) of the text so far, keeping back what may be part of a tag."""
        self._pending += text
        thinking = ""
        if self._state == "start":
            rest = self._pending.lstrip()
            if rest.startswith(THINK_OPEN):
                self._state, self._pending = "opened", rest[len(THINK_OPEN):]
            elif not final and THINK_OPEN.startswith(rest):
                return "", ""
            else:
                self._state = "content"
        if self._state == "opened":  # the blank line after <think> is not thinking
            self._pending = self._pending.lstrip()
            if not self._pending and not final:
                return "", ""
            self._state = "thinking"
        if self._state == "thinking":
            at = self._pending.find(THINK_CLOSE)
            if at < 0:  # kept back: what may start the closing tag, and the whitespace that may end the thinking
                cut = len(self._pending) - (0 if final else held_back(self._pending, THINK_CLOSE))
                thinking = self._pending[:cut].rstrip()
                self._pending = "" if final else self._pending[len(thinking):]
                return thinking, ""
            thinking, self._pending = self._pending[:at].rstrip(), self._pending[at + len(THINK_CLOSE):]
            self._state = "after"
        if self._state == "after":  # the blank lines between thinking and answer belong to neither
            self._pending = self._pending.lstrip()
            if not self._pending and not final:
                return thinking, ""
            self._state = "content"
        content, self._pending = self._pending, ""
        return thinking, content


class HarmonyOutput:
    """A harmony reply's parser (serving/harmony.py), or a Gemma 4 one's (serving/gemma4.py), behind OutputParser's
    calls."""

    def __init__(self, parser: HarmonyParser | Gemma4Parser | None = None) -> None:
        self._parser = parser or HarmonyParser()

    def feed(self, text: str) -> Output:
        thinking, content, calls = self._parser.feed(text)
        return Output(content, thinking, calls)

    def finish(self) -> Output:
        thinking, content, calls = self._parser.finish()
        return Output(content, thinking, calls, cut_call=getattr(self._parser, "cut", None))


class OutputParser:
    """Thinking first, then content in which tool calls are found."""

    def __init__(self, thinking: ThinkingParser | None, tools: ToolCallParser | None):
        self.thinking, self.tools = thinking, tools

    def feed(self, text: str) -> Output:
        return self._parse(text, False)

    def finish(self) -> Output:
        return self._parse("", True)

    def _parse(self, text: str, final: bool) -> Output:
        thinking, content = self.thinking.feed(text, final) if self.thinking else ("", text)
        if self.tools is None:
            return Output(content, thinking)
        content, calls = self.tools.feed(content)
        if final:
            more, more_calls = self.tools.finish()
            content, calls = content + more, calls + more_calls
        return Output(content, thinking, calls, cut_call=self.tools.cut if final else None)


# ---------------------------------------------------------------------------------------------------
# a request's plan


@dataclass
class ReplyPlan:
    """What one request asks of the reply, checked against the model's template: what the template is
    given, the grammar a forced call follows, and how the output is split."""

    template_args: dict[str, Any]            # passed to the chat template (tools, enable_thinking)
    tool_format: ToolFormat | None = None
    tools: list[dict[str, Any]] | None = None
    forced: list[dict[str, Any]] | None = None  # tool_choice: one of these must be called
    think: bool | None = None
    thinker: bool = False
    harmony: bool = False                    # the template writes gpt-oss's harmony format
    gemma4: bool = False                     # the template writes Gemma 4's format

    @classmethod
    def of(cls, request: GenerationRequest, template: str | None) -> "ReplyPlan":
        """The plan for `request` on a model whose chat template is `template`; OptionsError (a 400) for
        what the model cannot do, naming it."""
        harmony = is_harmony(template)
        level = request.think if request.think in THINK_LEVELS else None
        plan = cls({}, think=True if level else request.think, thinker=thinks(template), harmony=harmony,
                   gemma4=is_gemma4(template))
        if request.think is not None and not isinstance(request.think, bool) and not level:
            raise OptionsError(f"think: got {request.think!r}; accepted: true, false, or a level for gpt-oss's "
                               f"reasoning effort: {', '.join(map(repr, THINK_LEVELS))}")
        if harmony and level:
            plan.template_args["reasoning_effort"] = level
        if request.think and not plan.thinker:
            raise OptionsError(f"{request.model} does not support thinking: its chat template marks no "
                               f"{THINK_OPEN} part; leave think (and OpenAI's reasoning_effort) out")
        # The template switches thinking itself: Jinja's enable_thinking, or a Go template's .Think.
        if request.think is not None and plan.thinker and template and \
                ("enable_thinking" in template or ".Think" in template):
            plan.template_args["enable_thinking"] = request.think
        if request.tools:
            plan.tools = check_tools(request.tools)
            plan.tool_format = tool_format(template)
            if plan.tool_format is None:
                raise OptionsError(f"{request.model} does not support tools: its chat template takes none")
            plan.template_args["tools"] = plan.tools
            plan.forced = forced_tools(plan.tools, request.tool_choice)
            if plan.forced and plan.gemma4:
                raise OptionsError("tool_choice that forces a call is not supported for Gemma 4 (its calls are not "
                                   "JSON); set tool_choice to auto")
            if plan.forced and request.format not in (None, ""):
                raise OptionsError("format and tool_choice both constrain the output; send one of them")
            if plan.forced and request.think and not harmony:  # (gpt-oss: the call comes before any thinking)
                raise OptionsError("think: true with a tool_choice that forces a call is not supported: the "
                                   "forced call leaves no room to think; set think to false or tool_choice to auto")
        elif request.tool_choice not in (None, "auto", "none"):
            raise OptionsError("tool_choice needs tools: send the tools it may choose from")
        return plan

    def finish_prompt(self, text: str) -> str:
        """The rendered prompt, with an empty think block where think is false and the template has no
        switch of its own."""
        if self.gemma4 and text.endswith("<turn|>\n"):  # a turn closed after results: the model's turn opened, as
            return text + "<|turn>model\n"           # llama.cpp opens it
        if self.think is False and self.thinker and not self.harmony and not self.gemma4 and \
                "enable_thinking" not in self.template_args:
            if text.rstrip().endswith(THINK_OPEN):
                return text.rstrip() + "\n\n" + THINK_CLOSE + "\n\n"
            if not text.rstrip().endswith(THINK_CLOSE):
                return text + EMPTY_THINKING
        return text

    def grammar(self) -> str | None:
        """The Lark grammar that forces a call (tool_choice required or named), or None."""
        return call_grammar(self.tool_format, self.forced) if self.forced else None

    def parser(self, prompt: str) -> OutputParser | None:
        """The parser for the reply to `prompt`, or None when the text stays as the model writes it."""
        if self.harmony:  # its channels always come apart, as Ollama's harmony parser splits them
            return HarmonyOutput()
        if self.gemma4:   # so do Gemma 4's; its calls where tools were offered
            return HarmonyOutput(Gemma4Parser(tools=bool(self.tools)))
        thinking = ThinkingParser(inside=prompt.rstrip().endswith(THINK_OPEN)) if self.think else None
        tools = ToolCallParser(self.tool_format, self.tools, self.forced) if self.tools else None
        return OutputParser(thinking, tools) if thinking or tools else None

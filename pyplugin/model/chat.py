"""Chat prompts from the Jinja2 template a GGUF file carries (``tokenizer.chat_template``).

Templates come from model files, i.e. from strangers: they run in Jinja2's immutable sandbox, with
bounds on what one rendering may cost (MAX_OUTPUT characters, no string or list multiplied past it,
MAX_SECONDS of time checked as it loops and writes). The environment matches what Hugging Face's
``apply_chat_template`` offers templates (trim_blocks, lstrip_blocks, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson``), so templates written for it render the same here. A
file without a template gets a plain "Role: text" format.
"""

from __future__ import annotations

import json
import operator
import threading
import time
import warnings
from datetime import datetime
from typing import Any, Iterator, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from ..errors import PebblingError


class ChatTemplateError(PebblingError, ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed while rendering."""


# Used when the file has no template (or one that does not compile).
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


MAX_OUTPUT = 16 << 20  # characters: far past any prompt a context holds
MAX_SECONDS = 5.0

_deadline = threading.local()  # when the rendering on this thread must stop


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _check_time() -> None:
    if time.monotonic() > getattr(_deadline, "at", float("inf")):
        raise ChatTemplateError(f"chat template rendering took more than {MAX_SECONDS:g} s; it was stopped")


def _bounded_range(*args: int) -> Iterator[int]:
    """The sandbox's range (at most 100000 items), checking the time as it goes: nested loops that write
    nothing would otherwise spin unchecked."""
    for i, item in enumerate(safe_range(*args)):
        if not i & 1023:
            _check_time()
        yield item


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` on strings and lists refused past MAX_OUTPUT items."""

    intercepted_binops = frozenset(["*"])

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT:
                    raise SecurityError(f"a template may not build a sequence of {len(seq) * n} items "
                                        f"(at most {MAX_OUTPUT})")
            return operator.mul(left, right)
        return super().call_binop(context, operator_name, left, right)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _bounded_range
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


class ChatTemplate:
    """A compiled chat template. ``source`` is None for the plain fallback."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "",
                 origin: str = "model"):
        self.bos_token, self.eos_token = bos_token, eos_token
        env = _environment()
        self.source = source
        try:
            self._template = env.from_string(source or PLAIN_TEMPLATE)
        except jinja2.TemplateError as exc:
            # llama.cpp also falls back when it cannot parse a model's template.
            warnings.warn(f"{origin}: chat template does not compile ({exc}); using a plain format")
            self.source = None
            self._template = env.from_string(PLAIN_TEMPLATE)

    @property
    def is_fallback(self) -> bool:
        return self.source is None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for ``messages`` ([{'role': ..., 'content': ...}, ...])."""
        _deadline.at = time.monotonic() + MAX_SECONDS
        try:
            pieces, size = [], 0
            for piece in self._template.generate(messages=list(messages), bos_token=self.bos_token,
                                                 eos_token=self.eos_token,
                                                 add_generation_prompt=add_generation_prompt, **extra):
                size += len(piece)
                if size > MAX_OUTPUT:
                    raise ChatTemplateError(f"chat template wrote more than {MAX_OUTPUT} characters; it was "
                                            "stopped")
                _check_time()
                pieces.append(piece)
            return "".join(pieces)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template's own bug, or the sandbox refusing something
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _deadline.at = float("inf")

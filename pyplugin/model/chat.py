"""Chat prompts from the Jinja2 template a GGUF file carries (``tokenizer.chat_template``).

Templates come from model files, i.e. from strangers: they run in Jinja2's immutable sandbox. The
environment matches what Hugging Face's ``apply_chat_template`` offers templates (trim_blocks,
lstrip_blocks, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``), so templates
written for it render the same here. A file without a template gets a plain "Role: text" format.
"""

from __future__ import annotations

import json
import warnings
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.Undefined)
    env.globals["raise_exception"] = _raise_exception
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
        try:
            return self._template.render(messages=list(messages), bos_token=self.bos_token,
                                         eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt, **extra)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template's own bug, or the sandbox refusing something
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None

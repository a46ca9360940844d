"""Generation options, with Ollama's names and defaults, validated from a request's ``options``.

Keys this module does not know are ignored, as Ollama ignores them (num_gpu, mirostat, and the
pebbling_* options, which the server reads itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from ..errors import OptionsError

DEFAULT_NUM_CTX = 2048


@dataclass(frozen=True)
class Options:
    temperature: float = 0.8      # 0 = greedy
    top_k: int = 40               # 0 = no limit
    top_p: float = 0.9            # 1 = no limit
    min_p: float = 0.0            # 0 = no limit
    repeat_penalty: float = 1.1   # 1 = off
    repeat_last_n: int = 64       # tokens looked back for repeat_penalty; 0 = off, -1 = num_ctx
    seed: int | None = None       # None (or -1): a fresh seed per request
    num_predict: int = -1         # -1 = until end of generation or the context is full
    num_ctx: int = DEFAULT_NUM_CTX
    num_batch: int = 512          # prefill chunk, in tokens
    stop: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None, *,
                  n_ctx_train: int | None = None, max_ctx: int | None = None) -> "Options":
        """Validated options. ``n_ctx_train`` (the model's training context) and ``max_ctx`` (the
        server's limit) bound num_ctx; when num_ctx is not given the default is lowered to them rather
        than refused."""
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise OptionsError(f"options must be an object, got {type(values).__name__}")
        parsed: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in values and values[f.name] is not None:
                parsed[f.name] = _CHECKS[f.name](f.name, values[f.name])
        if parsed.get("seed") == -1:
            parsed["seed"] = None
        bounds = [(n_ctx_train, "this model's training context"), (max_ctx, "this server's limit")]
        for bound, what in bounds:
            if bound and parsed.get("num_ctx", 0) > bound:
                raise OptionsError(f"option 'num_ctx': {str(parsed['num_ctx'])[:20]} is beyond {what}; "
                                   f"accepted: 1 to {min(b for b, _ in bounds if b)}")
        limits = [b for b, _ in bounds if b]
        if limits:
            parsed.setdefault("num_ctx", min(DEFAULT_NUM_CTX, *limits))
        return cls(**parsed)


# ---------------------------------------------------------------------------------------------------
# checks: each takes (name, value) and returns the value or raises OptionsError


def _fail(name: str, value: Any, accepted: str) -> OptionsError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return OptionsError(f"option {name!r}: got {shown} ({type(value).__name__}); accepted: {accepted}")


def _number(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str, Any], float]:
    if high == math.inf:
        accepted = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        accepted = f"a number from {low:g} to {high:g}"

    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(name, value, accepted)
        try:
            value = float(value)
        except OverflowError:  # an integer past float's range
            raise _fail(name, value, accepted) from None
        if not math.isfinite(value):
            raise _fail(name, value, accepted)
        if value < low or value > high or (low_open and value == low):
            raise _fail(name, value, accepted)
        return float(value)
    return check


def _integer(low: int, high: int | None = None, note: str = "") -> Callable[[str, Any], int]:
    accepted = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    accepted += note

    def check(name: str, value: Any) -> int:
        # JSON numbers may arrive as 40.0; a whole float is accepted, as Ollama does.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(name, value, accepted)
        if value < low or (high is not None and value > high):
            raise _fail(name, value, accepted)
        return value
    return check


def _stop(name: str, value: Any) -> tuple[str, ...]:
    accepted = "a string or a list of non-empty strings"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise _fail(name, value, accepted)
    return tuple(value)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "temperature": _number(0.0),
    "top_k": _integer(0, note=" (0 = no limit)"),
    "top_p": _number(0.0, 1.0),
    "min_p": _number(0.0, 1.0),
    "repeat_penalty": _number(0.0, low_open=True),
    "repeat_last_n": _integer(-1, note=" (-1 = num_ctx, 0 = off)"),
    "seed": _integer(-1, note=" (-1 = random)"),
    "num_predict": _integer(-1, note=" (-1 = until the end of generation)"),
    "num_ctx": _integer(1),
    "num_batch": _integer(1),
    "stop": _stop,
}

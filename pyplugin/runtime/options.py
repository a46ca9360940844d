"""Generation options, with Ollama's names and defaults, validated from a request's ``options``.

Nothing is silently ignored: an option that changes what is generated and that pebbling does not
implement (tfs_z, typical_p, ...) is refused unless it is given its neutral value, and a key
that is no option at all is refused naming it. Ollama's options for where a model runs (num_gpu,
num_thread, use_mmap, ...) are accepted and have no effect, since pebbling decides placement itself
(the pebbling_* options, read by the plan); so are the pebbling_* keys here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from ..errors import OptionsError
from ..kv_types import default_kv_type, kv_fallback, kv_type

DEFAULT_NUM_CTX = 2048
OPEN_ENDED_CONTEXTS = 10  # Ollama's bound on num_predict: 10 x num_ctx (llm/server.go, llm/llama_server.go)


@dataclass(frozen=True)
class Options:
    temperature: float = 0.8      # 0 = greedy
    top_k: int = 40               # 0 = no limit
    top_p: float = 0.9            # 1 = no limit
    min_p: float = 0.0            # 0 = no limit
    repeat_penalty: float = 1.1   # 1 = off
    repeat_last_n: int = 64       # tokens looked back for repeat_penalty; 0 = off, -1 = num_ctx
    seed: int | None = None       # None (or -1): a fresh seed per request
    num_predict: int = -1         # -1: until end of generation (at most 10 x num_ctx); -2: until the context is full
    num_ctx: int = DEFAULT_NUM_CTX
    num_batch: int = 512          # prefill chunk, in tokens
    num_keep: int = 4             # tokens kept at the start when a prompt is cut or the context shifts
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0   # subtracted from a token's logit once it appears in the last repeat_last_n
    frequency_penalty: float = 0.0  # ... times the number of times it appears there
    mirostat: int = 0             # 1 or 2: Mirostat's sampling towards a surprise of mirostat_tau (sampling.py)
    mirostat_tau: float = 5.0     # the surprise it aims at, in bits per token
    mirostat_eta: float = 0.1     # how fast it corrects its truncation towards it
    kv_type: str = field(default_factory=default_kv_type)  # pebbling_kv_type, else the server's (kv_types.py)
    shift: bool = True            # the request's `shift` (not an option): a full context shifts to go on
    kv_fallback: str = ""         # (not an option) why kv_type is f16, not the server's (kv_types.kv_fallback)

    @property
    def predict_limit(self) -> int | None:
        """The most tokens a generation makes, as Ollama bounds them: num_predict, and at most
        OPEN_ENDED_CONTEXTS x num_ctx, which is also -1's limit, so that a generation that shifts its
        context cannot run forever. -2: None, the generation ends with its context (it never shifts)."""
        if self.num_predict == -2:
            return None
        bound = OPEN_ENDED_CONTEXTS * self.num_ctx
        return bound if self.num_predict < 0 else min(self.num_predict, bound)

    @property
    def shifts(self) -> bool:
        """Whether a full context shifts so that the generation goes on (not for num_predict -2)."""
        return self.shift and self.num_predict != -2

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None, *, n_ctx_train: int | None = None,
                  max_ctx: int | None = None, head_dim: int | None = None) -> "Options":
        """Validated options. ``n_ctx_train`` (the model's training context) and ``max_ctx`` (the
        server's limit) bound num_ctx: a larger num_ctx, or the default, is lowered to them (clamped, as
        Ollama does, rather than refused; the caller compares with what was asked to warn). ``head_dim``
        (the model's): without pebbling_kv_type, the server's KV type where its blocks fit such heads,
        else f16 (kv_fallback says why), where a type the request names that does not fit is refused."""
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise OptionsError(f"options must be an object, got {type(values).__name__}")
        for key, value in values.items():
            _check_unimplemented(key, value)
        parsed: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in values and values[f.name] is not None:
                parsed[f.name] = _CHECKS[f.name](f.name, values[f.name])
        if values.get("pebbling_kv_type") is not None:
            parsed["kv_type"] = kv_type(values["pebbling_kv_type"]).name
        elif head_dim is not None:
            parsed["kv_type"], parsed["kv_fallback"] = default_kv_type(head_dim), kv_fallback(head_dim)
        if parsed.get("seed") == -1:
            parsed["seed"] = None
        limits = [b for b in (n_ctx_train, max_ctx) if b]
        if limits:
            parsed["num_ctx"] = min(parsed.get("num_ctx", DEFAULT_NUM_CTX), *limits)
        return cls(**parsed)


# ---------------------------------------------------------------------------------------------------
# checks: each takes (name, value) and returns the value or raises OptionsError


def _fail(name: str, value: Any, accepted: str) -> OptionsError:
    return OptionsError(f"option {name!r}: got {_shown(value)} ({type(value).__name__}); accepted: {accepted}")


def _number(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str, Any], float]:
    if high == math.inf:
        accepted = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        accepted = f"a number from {low:g} to {high:g}"

    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(name, value, accepted)
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range
            raise _fail(name, value, accepted) from None
        if not math.isfinite(number) or number < low or number > high or (low_open and number == low):
            raise _fail(name, value, accepted)
        return number
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
    "num_predict": _integer(-2, note=" (-1 = until the end of generation, at most 10 x num_ctx; -2 = until the "
                                     "context is full)"),
    "num_keep": _integer(0),
    "num_ctx": _integer(1),
    "num_batch": _integer(1),
    "stop": _stop,
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "mirostat": _integer(0, 2, " (0 = off, 1 = Mirostat, 2 = Mirostat 2.0)"),
    "mirostat_tau": _number(0.0),
    "mirostat_eta": _number(0.0),
}

# Where a model runs: pebbling plans that itself (pebbling_strategy, pebbling_memory_limit).
PLACEMENT = frozenset({"num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa", "low_vram",
                       "f16_kv", "vocab_only", "logits_all", "embedding_only", "num_gqa", "rope_frequency_base",
                       "rope_frequency_scale"})
# Sampling options not implemented, with the value that leaves sampling as it is.
NEUTRAL = {"tfs_z": 1.0, "typical_p": 1.0, "penalize_newline": False}
PEBBLING = frozenset({"pebbling_strategy", "pebbling_enabled", "pebbling_memory_limit", "pebbling_weights",
                      "pebbling_cache_prompt", "pebbling_kv_type", "pebbling_expert_cache",
                      "pebbling_expert_prefetch", "pebbling_expert_policy"})


def _check_unimplemented(key: Any, value: Any) -> None:
    if key in _CHECKS or key in PLACEMENT or key in PEBBLING:
        return
    if key in NEUTRAL:
        neutral = NEUTRAL[key]
        if neutral is None or value is None or value == neutral:  # None: no effect without the others
            return
        raise OptionsError(f"option {key!r}: {_shown(value)} is not implemented by pebbling; leave it out or give "
                           f"it {json_text(neutral)}")
    known = ", ".join(sorted(_CHECKS))
    raise OptionsError(f"option {_shown(key)} is not an option pebbling knows; options: {known}, the "
                       "pebbling_* ones, and Ollama's placement options (num_gpu, num_thread, ...), which have "
                       "no effect here")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def json_text(value: Any) -> str:
    return "false" if value is False else "true" if value is True else repr(value)

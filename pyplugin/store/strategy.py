"""Strategies: which layers a strategy keeps resident on the device (its checkpoints).

This is the one place the rule is written in Python; the native library implements the same rule
(native/store_tiers.cu, resident_count/is_resident) and a test holds the two together.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import StrategyError
from .abi import STRATEGY_ADAPTIVE as ADAPTIVE
from .abi import STRATEGY_EVERY as EVERY
from .abi import STRATEGY_MINIMAL as MINIMAL
from .abi import STRATEGY_NONE as NONE
from .abi import STRATEGY_SQRT as SQRT

_CODES = {"none": NONE, "sqrt": SQRT, "adaptive": ADAPTIVE, "minimal": MINIMAL}
VALID_STRATEGIES = "none, sqrt, adaptive, minimal, every:N (N >= 1)"


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy: ``code`` as in pebble.h, ``arg`` = N for every:N, k for adaptive."""

    name: str
    code: int
    arg: int = 0

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        if not isinstance(text, str):
            raise StrategyError(f"pebbling_strategy must be a string, got {type(text).__name__}; "
                                f"valid: {VALID_STRATEGIES}")
        name = text.strip().lower()
        if name in _CODES:
            return cls(name, _CODES[name])
        if name.startswith("every:"):
            n = name.split(":", 1)[1]
            # ASCII digits only: str.isdigit() takes "²" and "٢", which int() refuses or reads as 2.
            if re.fullmatch(r"[0-9]{1,9}", n) and int(n) >= 1:
                return cls(f"every:{int(n)}", EVERY, int(n))
            raise StrategyError(f"strategy {text[:40]!r}: N in every:N must be an integer from 1 to "
                                f"999999999 in ASCII digits; valid: {VALID_STRATEGIES}")
        raise StrategyError(f"unknown strategy {text[:40]!r}; valid: {VALID_STRATEGIES}")

    def __str__(self) -> str:
        return self.name


def resident_count(code: int, arg: int, n_layers: int) -> int:
    """How many of ``n_layers`` layers the strategy keeps resident."""
    if n_layers < 1:
        raise StrategyError(f"a model needs at least one layer, got {n_layers}")
    if code == NONE:
        return n_layers
    if code == SQRT:
        return min(n_layers, math.isqrt(n_layers - 1) + 1)  # ceil(sqrt(L))
    if code == MINIMAL:
        return 0
    if code == ADAPTIVE:
        if not 0 <= arg <= n_layers:
            raise StrategyError(f"adaptive keeps 0..{n_layers} layers resident, got {arg}")
        return arg
    if code == EVERY:
        if arg < 1:
            raise StrategyError(f"every:N needs N >= 1, got {arg}; valid: {VALID_STRATEGIES}")
        return (n_layers + arg - 1) // arg
    raise StrategyError(f"unknown strategy code {code}; valid: {VALID_STRATEGIES}")


def is_resident(code: int, arg: int, n_layers: int, layer: int) -> bool:
    """Whether ``layer`` is a checkpoint. k of L layers: layer i iff (i*k) mod L < k (evenly spaced)."""
    if code == EVERY:
        resident_count(code, arg, n_layers)  # validates arg
        return layer % arg == 0
    k = resident_count(code, arg, n_layers)
    return (layer * k) % n_layers < k


def resident_layers(code: int, arg: int, n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if is_resident(code, arg, n_layers, i)]

"""What the subcommands share: loading a model into a store (timed), the flags they have in common,
and how figures are printed."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from ..model import WEIGHT_FORMS, Model, load_model
from ..runtime import Options, PebbledModel, PebblingOptions
from ..runtime.plan import parse_size
from ..serving.registry import resolve
from ..store import BACKENDS, VALID_STRATEGIES, Strategy


@dataclass
class Loaded:
    model: Model
    pebbled: PebbledModel
    path: Path
    load_ns: int  # reading the file and saving its layers into the store


def load_pebbled(name: str, backend: str | None = None, weights: str = "quantized") -> Loaded:
    """The model `name` read with its weights in form `weights` and saved into a store of `backend`."""
    start = time.perf_counter_ns()
    path = resolve(name)
    model = load_model(path, weights=weights)
    pebbled = PebbledModel(model, backend=backend)
    return Loaded(model, pebbled, path, time.perf_counter_ns() - start)


def options_from_flags(model: Model, **given) -> Options:
    """Ollama's options from the flags that were given (None: not given), checked against the model."""
    return Options.from_dict({k: v for k, v in given.items() if v is not None},
                             n_ctx_train=model.config.n_ctx_train, head_dim=model.config.head_dim)


def chat_tokens(model: Model, prompt: str, *, raw: bool = False) -> list[int]:
    """A user's message through the model's chat template (or, raw, the text as it is), tokenized."""
    return model.tokenizer.encode(prompt if raw else model.chat_prompt([{"role": "user", "content": prompt}]))


# ---------------------------------------------------------------------------------------------------
# flags


def add_pebbling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pebbling-strategy", metavar="S",
                   help=f"{VALID_STRATEGIES} (default adaptive)")
    p.add_argument("--pebbling-memory-limit", metavar="SIZE",
                   help="device memory budget, e.g. 512MiB or 6GiB (default: none on host and stub, "
                        "the free GPU memory on cuda)")
    add_weights_argument(p)
    add_backend_argument(p)


def add_weights_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pebbling-weights", choices=WEIGHT_FORMS, default=WEIGHT_FORMS[0],
                   help="quantized (default): weight matrices stay in their GGUF type, in memory, on the "
                        "bus and in the kernels; f16: expanded once at load (more memory, for comparison)")


def add_backend_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS,
                   help="store backend (default $PEBBLING_BACKEND, else the first of cuda, host, stub "
                        "that works); computation is CuPy on cuda, numpy elsewhere")


def pebbling_options(strategy: str | None, limit: str | None, weights: str | None = None,
                     limit_flag: str = "--pebbling-memory-limit") -> PebblingOptions:
    """The flags' values, checked; errors name the flag."""
    return PebblingOptions(None if strategy is None else Strategy.parse(strategy), None,
                           None if limit is None else parse_size(limit, limit_flag), weights)


# ---------------------------------------------------------------------------------------------------
# printing


def plain(doc: str | None) -> str:
    """A module docstring as a terminal help text: without the backquotes that mark code in it."""
    return (doc or "").replace("``", "").replace("`", "").strip()


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: numbers right-aligned, the first and last (text) left."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    last = len(header) - 1

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i in (0, last) else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), *map(line, rows)])


def format_duration(ns: int) -> str:
    """Like Go's time.Duration, as Ollama prints it: 1.234s, 56.78ms, 910µs."""
    for unit, size in (("s", 10**9), ("ms", 10**6), ("µs", 10**3)):
        if ns >= size:
            return f"{ns / size:.6g}{unit}"
    return f"{ns}ns"


def decode_rate(stats) -> float | None:
    """Tokens generated per second of decode (Ollama's eval rate), None when nothing was decoded."""
    return stats.generated_tokens / (stats.generate_ns / 1e9) if stats.generate_ns else None

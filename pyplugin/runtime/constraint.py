"""Constrained decoding: a grammar the output must follow, applied to the logits before each token is
sampled, so that structured output always parses and validates.

The grammar engine is llguidance (JSON schemas compiled to its grammars; a token mask computed per step
in Rust). `Constraint.from_format` reads Ollama's `format` ("json", or a JSON schema) and OpenAI's
`response_format` turned into the same. The output is compact JSON (no whitespace between tokens of
the structure), as a schema's consumer expects and as a small model keeps to best.
"""

from __future__ import annotations

import json
import time
import weakref
from typing import Any

import llguidance
import numpy as np

from ..errors import OptionsError
from ..model import Tokenizer

FORMAT_HELP = '"json", or a JSON schema (an object such as {"type": "object", "properties": {...}})'
_COMPILE = {"whitespace_flexible": False}
_tokenizers: "weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists its `properties` and says nothing of others closed to
    them (additionalProperties: false), as Ollama reads a schema (llama.cpp's converter adds other
    keys only where additionalProperties allows them). Pydantic's schemas say nothing, so without
    this a small model is free to invent keys until it runs out of tokens; with it the object ends
    once its properties are written. Explicit additionalProperties or patternProperties are kept."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[key] = {k: closed_objects(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not",
                     "if", "then", "else", "contains"):
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends (its internals, not the client's business)."""
    return error.split("\n<state>", 1)[0].split("\n", 1)[0].strip()


class _Vocabulary:
    """What llguidance asks of a tokenizer: each token's bytes, the specials, and encoding."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i, special=True) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = [i for i in range(tokenizer.n_vocab) if tokenizer.is_special(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self.tokenizer.encode_fragment(text)


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance holds it, made once per tokenizer (it indexes the whole vocabulary)."""
    found = _tokenizers.get(tokenizer)
    if found is None:
        ends = sorted(tokenizer.eog_ids) or None  # any end-of-generation token may end the output
        found = _tokenizers[tokenizer] = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), n_vocab=tokenizer.n_vocab, eos_token=ends)
    return found


class Constraint:
    """One request's grammar. `mask(logits)` before sampling, `accept(token)` after; `stopped` once the
    output is complete (only an end-of-generation token may follow)."""

    def __init__(self, tokenizer: Tokenizer, grammar: str, what: str):
        self.what, self.n_vocab = what, tokenizer.n_vocab
        ll = _ll_tokenizer(tokenizer)
        try:
            self.matcher = llguidance.LLMatcher(ll, grammar)
        except (ValueError, RuntimeError) as exc:
            raise OptionsError(f"{what}: the grammar cannot be built: {exc}") from None
        if self.matcher.is_error():
            raise OptionsError(f"{what}: {_first_line(self.matcher.get_error())}")
        self._bits = np.zeros((ll.vocab_size + 31) // 32, dtype=np.int32)
        self.ns = 0  # time spent in the grammar (masks and steps), for measurements

    @classmethod
    def from_format(cls, tokenizer: Tokenizer, fmt: Any, what: str = "format") -> "Constraint | None":
        """Ollama's `format`: None or "" (no constraint), "json" (any JSON object), or a JSON schema."""
        if fmt is None or fmt == "":
            return None
        if fmt == "json":
            schema: Any = {"type": "object"}
        elif isinstance(fmt, dict):
            schema = closed_objects(fmt)
        else:
            raise OptionsError(f"{what}: got {json.dumps(fmt)[:60]}; accepted: {FORMAT_HELP}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPILE)
        except ValueError as exc:
            raise OptionsError(f"{what}: not a JSON schema: {exc}") from None
        return cls(tokenizer, grammar, what)

    @classmethod
    def from_lark(cls, tokenizer: Tokenizer, grammar: str, what: str) -> "Constraint":
        """A grammar in llguidance's Lark dialect (which may embed JSON schemas as `%json {...}`)."""
        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        except ValueError as exc:
            raise OptionsError(f"{what}: the grammar cannot be built: {exc}") from None
        return cls(tokenizer, compiled, what)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the logits with every token the grammar does not allow next at -inf."""
        start = time.perf_counter_ns()
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)
        out = np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)
        self.ns += time.perf_counter_ns() - start
        return out

    def accept(self, token: int) -> None:
        start = time.perf_counter_ns()
        accepted = self.matcher.consume_token(int(token))
        self.ns += time.perf_counter_ns() - start
        if not accepted:
            raise OptionsError(f"{self.what}: token {token} breaks the grammar: "
                               f"{_first_line(self.matcher.get_error())} (a recursive or very large schema "
                               f"can do this: simplify it)")

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

"""The inference loop: prefill in chunks, then decode one token at a time, sampling each.

A layer's weights are fetched through one callable, ``layer_weights(i) -> LayerWeights``, called
just before layer i computes. By default every layer is resident (``Model.resident_layers``); a
store-backed source that restores layers into device slots plugs in here without the loop changing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterator, Sequence

import numpy as np

from .errors import OptionsError
from .model import KVCache, LayerWeights, Model, embed, layer_forward, output_logits
from .options import Options
from .sampling import Sampler
from .xp import to_numpy

LayerSource = Callable[[int], LayerWeights]


@dataclass
class Stats:
    """What one request cost, in Ollama's terms."""

    prompt_tokens: int = 0
    prompt_ns: int = 0
    generated_tokens: int = 0
    generate_ns: int = 0
    done_reason: str | None = None     # "stop" (end of generation or a stop string) or "length"


class Generation:
    """One request: its KV cache, position, sampler and stats."""

    def __init__(self, model: Model, options: Options, *, layer_weights: LayerSource | None = None,
                 kv: KVCache | None = None, xp: ModuleType = np):
        self.model, self.options, self.xp = model, options, xp
        self.cfg = model.config
        self.layer_weights = layer_weights or model.resident_layers(xp).__getitem__
        self.outer = model.outer_weights(xp)
        self.kv = kv if kv is not None else KVCache.allocate(self.cfg, options.num_ctx, xp)
        self.sampler = Sampler(options)
        self.pos = 0
        self.stats = Stats()

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens through every layer at the current position; float32 logits of the last one."""
        x = embed(self.outer, tokens, self.xp)                                     # [T, n_embd]
        for i in range(self.cfg.n_layer):
            x = layer_forward(self.cfg, x, self.layer_weights(i), self.kv.k[i], self.kv.v[i], self.pos)
        self.pos += len(tokens)
        return to_numpy(output_logits(self.cfg, self.outer, x[-1]))               # [n_vocab]

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """The prompt in chunks of num_batch tokens, so the workspace stays bounded."""
        start = time.perf_counter_ns()
        step = self.options.num_batch
        for i in range(0, len(tokens), step):
            logits = self.forward(tokens[i:i + step])
        self.stats.prompt_tokens += len(tokens)
        self.stats.prompt_ns += time.perf_counter_ns() - start
        return logits

    def decode_one(self, token: int) -> np.ndarray:
        return self.forward([token])

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        return self.sampler(logits, history)

    def tokens(self, prompt: Sequence[int]) -> Iterator[int]:
        """Generated token ids, until end of generation, num_predict or a full context."""
        prompt = list(prompt)
        self._check_prompt(prompt)
        logits = self.prefill(prompt)
        history, limit = prompt, self.options.num_predict
        while limit < 0 or self.stats.generated_tokens < limit:
            start = time.perf_counter_ns()
            token = self.sample(logits, history)
            self.stats.generate_ns += time.perf_counter_ns() - start
            if token in self.model.tokenizer.eog_ids:
                self.stats.done_reason = "stop"
                return
            self.stats.generated_tokens += 1
            history.append(token)
            yield token
            if self.pos >= self.kv.n_ctx:
                break
            start = time.perf_counter_ns()
            logits = self.decode_one(token)
            self.stats.generate_ns += time.perf_counter_ns() - start
        self.stats.done_reason = "length"

    def text(self, prompt: Sequence[int]) -> Iterator[str]:
        """Generated text as it comes: whole characters only, cut before the first stop string."""
        decoder = self.model.tokenizer.stream_decoder()
        stops, pending = self.options.stop, ""
        tokens = self.tokens(prompt)
        try:
            for token in tokens:
                pending += decoder.push(token)
                cut = _find_stop(pending, stops)
                if cut is not None:
                    self.stats.done_reason = "stop"
                    pending = pending[:cut]
                    break
                ready = len(pending) - _held_back(pending, stops)
                if ready:
                    yield pending[:ready]
                    pending = pending[ready:]
            else:
                pending += decoder.flush()
                cut = _find_stop(pending, stops)
                if cut is not None:
                    self.stats.done_reason, pending = "stop", pending[:cut]
        finally:
            tokens.close()
        if pending:
            yield pending

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise OptionsError("the prompt is empty: there is nothing to continue from")
        if len(prompt) + self.pos > self.kv.n_ctx:
            raise OptionsError(f"the prompt is {len(prompt)} tokens, more than num_ctx "
                               f"({self.kv.n_ctx}); raise num_ctx (this model was trained on "
                               f"{self.cfg.n_ctx_train}) or shorten the prompt")
        bad = [t for t in prompt if not 0 <= t < self.cfg.n_vocab]
        if bad:
            raise OptionsError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.cfg.n_vocab - 1})")


def generate(model: Model, prompt_tokens: Sequence[int], options: Options | None = None, *,
             layer_weights: LayerSource | None = None, kv: KVCache | None = None,
             xp: ModuleType = np) -> Iterator[int]:
    """Generated token ids for a tokenized prompt (see ``Generation`` for text and stats)."""
    gen = Generation(model, options or Options(), layer_weights=layer_weights, kv=kv, xp=xp)
    return gen.tokens(prompt_tokens)


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest

"""The inference loop: prefill in chunks, then decode one token at a time, sampling each.

The loop reaches a layer's state (weights and KV cache) only through a `LayerSource`, asked for
layer i just before it computes and told when it is done; the source also says which array module
the request computes in and holds the outer weights placed for it. `ResidentLayers` keeps every layer
in memory; `StoreLayers` (store_layers.py) runs a plan through a pebble store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from ..errors import OptionsError
from ..model import KVCache, LayerWeights, Model, OuterWeights, embed, layer_forward, output_logits
from ..model.transformer import rms_norm, rope_table
from ..store import Kernels, LayerShape, fused_decode_computes, select_backend
from ..xp import compute_dtype, to_numpy
from .constraint import Constraint
from .logprobs import TokenLogprob, token_logprob
from .options import Options
from .sampling import Sampler

Array = Any


class LayerSource(Protocol):
    """Where the loop finds each layer's weights and KV cache."""

    n_ctx: int
    xp: ModuleType                      # the array module the request computes in
    outer: OuterWeights                 # the weights outside the layer stack, placed for xp
    decode_kernels: Kernels | None      # run a decode step's layers one native call each, when given

    def begin(self, pos: int, n_tokens: int) -> None:
        """A forward pass over positions pos..pos+n_tokens is about to run through every layer."""

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        """Layer i's weights, K cache and V cache [n_ctx, n_head_kv, head_dim], ready to compute."""

    def done(self, i: int) -> None:
        """Layer i has computed (its new KV rows are written in the arrays `layer` gave)."""


class ResidentLayers:
    """Every layer's weights and KV cache held in memory for the whole request (no store), computed
    by `kernels` in their array module (default: the selected backend's kernels for numpy arrays)."""

    decode_kernels = None

    def __init__(self, model: Model, n_ctx: int, kernels: Kernels | None = None):
        kernels = kernels or select_backend().host_kernels
        self.xp = kernels.xp
        self.weights = model.resident_layers(kernels)
        self.outer = model.outer_weights(kernels)
        self.kv = KVCache.allocate(model.config, n_ctx, self.xp)
        self.n_ctx = n_ctx

    def begin(self, pos: int, n_tokens: int) -> None:
        pass

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        return self.weights[i], self.kv.k[i], self.kv.v[i]

    def done(self, i: int) -> None:
        pass


@dataclass
class GenerationStats:
    """What one request cost, in Ollama's terms."""

    prompt_tokens: int = 0             # the prompt tokens processed (not those found in the cache)
    cached_tokens: int = 0             # the prompt tokens whose K and V were already in the cache
    prompt_ns: int = 0
    generated_tokens: int = 0
    generate_ns: int = 0
    done_reason: str | None = None     # "stop" (end of generation or a stop string) or "length"


class Generation:
    """One request: its layer source (and so its KV cache), position, sampler and stats."""

    def __init__(self, model: Model, options: Options, *, layers: LayerSource | None = None,
                 should_stop: Callable[[], bool] | None = None, constraint: Constraint | None = None,
                 logprobs: int | None = None):
        """`constraint`: a grammar the output must follow (structured output), masking the logits.
        `logprobs`: None, or record each generated token's logprob and the `logprobs` most likely
        tokens' in `self.logprobs` (see logprobs.py)."""
        self.model, self.options, self.constraint = model, options, constraint
        self.top_logprobs = logprobs
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.cfg = model.config
        self.layers = layers if layers is not None else ResidentLayers(model, options.num_ctx)
        self.xp, self.outer = self.layers.xp, self.layers.outer
        self.sampler = Sampler(options)
        self.should_stop = should_stop or (lambda: False)
        self.prompt: list[int] = []
        self.generated: list[int] = []
        self.pos = 0
        self.stats = GenerationStats()
        # Kernels that run a whole layer per call at decode (pebble_decode_layer), where the source has them;
        # a layer they cannot compute (fused_decode_computes) goes through the array path instead.
        self.decode_kernels = self.layers.decode_kernels
        self.layer_cfgs = [self.cfg.for_layer(i) for i in range(self.cfg.n_layer)]
        self.layer_shapes = [LayerShape.of(c) for c in self.layer_cfgs] if self.decode_kernels is not None else []

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens through every layer at the current position; float32 logits of the last one."""
        if len(tokens) == 1 and self.decode_kernels is not None:
            return self._decode_step(tokens[0])
        x = self._through_layers(tokens)                                           # [T, n_embd]
        return to_numpy(output_logits(self.cfg, self.outer, x[-1]))               # [n_vocab]

    def _through_layers(self, tokens: Sequence[int]) -> Any:
        x = embed(self.outer, tokens, self.xp, self.cfg.embd_scale)                # [T, n_embd]
        self.layers.begin(self.pos, len(tokens))
        for i, cfg in enumerate(self.layer_cfgs):
            weights, k_cache, v_cache = self.layers.layer(i)
            rope = tuple(t[self.pos:self.pos + len(tokens)] for t in rope_table(cfg, self.layers.n_ctx, self.xp))
            x = layer_forward(cfg, x, weights, k_cache, v_cache, self.pos, rope)
            self.layers.done(i)
        self.pos += len(tokens)
        return x

    def hidden_states(self, tokens: Sequence[int]) -> np.ndarray:
        """The model's final hidden states of `tokens` (after the output norm), float32 [T, n_embd]: what
        embeddings pool. The prompt goes in chunks of num_batch tokens, as in prefill."""
        self._check_prompt(list(tokens))
        start, states = time.perf_counter_ns(), []
        for i in range(0, len(tokens), self.options.num_batch):
            x = self._through_layers(tokens[i:i + self.options.num_batch])
            states.append(to_numpy(rms_norm(x, self.outer.output_norm, self.cfg.rms_eps)).astype(np.float32))
        self.stats.prompt_tokens += len(tokens)
        self.stats.prompt_ns += time.perf_counter_ns() - start
        return np.concatenate(states)

    def _decode_step(self, token: int) -> np.ndarray:
        """One token through every layer, each layer one native call where the fused step computes it (else
        the array path, in place); the residual stream stays float32."""
        xp, cfg, pos = self.xp, self.cfg, self.pos
        x = xp.ascontiguousarray(embed(self.outer, [token], xp, cfg.embd_scale)[0], dtype=np.float32)  # [n_embd]
        self.layers.begin(pos, 1)
        for i, lcfg in enumerate(self.layer_cfgs):
            weights, k_cache, v_cache = self.layers.layer(i)
            if fused_decode_computes(lcfg, weights):
                cos, sin = rope_table(lcfg, self.layers.n_ctx, xp, np.float32)
                self.decode_kernels.decode_layer(self.layer_shapes[i], weights, k_cache, v_cache, pos, x,
                                                 cos[pos, 0], sin[pos, 0], lcfg.query_scale)
            else:
                rope = tuple(t[pos:pos + 1] for t in rope_table(lcfg, self.layers.n_ctx, xp))
                h = layer_forward(lcfg, x[None].astype(compute_dtype(xp)), weights, k_cache, v_cache, pos, rope)
                x[:] = h[0]
            self.layers.done(i)
        self.pos += 1
        return to_numpy(output_logits(cfg, self.outer, x.astype(compute_dtype(xp), copy=False)))

    def report(self) -> dict[str, Any] | None:
        """The pebbling report when the layers come from a store, else None."""
        report = getattr(self.layers, "report", None)
        return report(self.stats) if report else None

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

    def tokens(self, prompt: Sequence[int], cached: int = 0) -> Iterator[int]:
        """Generated token ids, until end of generation, num_predict or a full context. `cached`: how many
        leading prompt tokens the layers' KV caches already hold (a conversation going on); only the
        rest is prefilled."""
        prompt = list(prompt)
        self._check_prompt(prompt)
        self.prompt = list(prompt)
        if not 0 <= cached < len(prompt):
            raise OptionsError(f"{cached} cached tokens of a {len(prompt)}-token prompt: at least its last "
                               "token must run")
        self.pos = self.stats.cached_tokens = cached
        logits = self.prefill(prompt[cached:])
        history, limit = prompt, self.options.num_predict
        while limit < 0 or self.stats.generated_tokens < limit:
            start = time.perf_counter_ns()
            raw = logits
            if self.constraint is not None:
                logits = self.constraint.mask(logits)
            token = self.sample(logits, history)
            if self.constraint is not None and token not in self.model.tokenizer.eog_ids:
                self.constraint.accept(token)
            self.stats.generate_ns += time.perf_counter_ns() - start
            if token in self.model.tokenizer.eog_ids:
                self.stats.done_reason = "stop"
                return
            if self.should_stop():  # checked per token, before the token is used
                self.stats.done_reason = "cancelled"
                return
            if self.logprobs is not None:  # of the raw logits, before any penalty or mask
                self.logprobs.append(token_logprob(raw, token, self.top_logprobs))
            self.stats.generated_tokens += 1
            self.generated.append(token)
            history.append(token)
            yield token
            if self.constraint is not None and self.constraint.stopped:
                self.stats.done_reason = "stop"  # the grammar is complete: only an end could follow
                return
            if self.pos >= self.layers.n_ctx or self.stats.generated_tokens == limit:
                break  # no forward pass for a token that will not be sampled
            start = time.perf_counter_ns()
            logits = self.decode_one(token)
            self.stats.generate_ns += time.perf_counter_ns() - start
        self.stats.done_reason = "length"

    def forwarded(self) -> list[int]:
        """The tokens whose K and V the caches now hold, in position order."""
        return (self.prompt + self.generated)[:self.pos]

    def text(self, prompt: Sequence[int], cached: int = 0) -> Iterator[str]:
        """Generated text as it comes: whole characters only, cut before the first stop string."""
        decoder = self.model.tokenizer.stream_decoder()
        stops, pending = self.options.stop, ""
        tokens = self.tokens(prompt, cached)
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
        if len(prompt) + self.pos > self.layers.n_ctx:
            raise OptionsError(f"the prompt is {len(prompt)} tokens, more than num_ctx "
                               f"({self.layers.n_ctx}); raise num_ctx (this model was trained on "
                               f"{self.cfg.n_ctx_train}) or shorten the prompt")
        bad = [t for t in prompt if not 0 <= t < self.cfg.n_vocab]
        if bad:
            raise OptionsError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.cfg.n_vocab - 1})")


def generate(model: Model, prompt_tokens: Sequence[int], options: Options | None = None, *,
             layers: LayerSource | None = None) -> Iterator[int]:
    """Generated token ids for a tokenized prompt (see ``Generation`` for text and stats)."""
    gen = Generation(model, options or Options(), layers=layers)
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

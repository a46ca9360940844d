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
from ..model.gemma4 import per_layer_inputs
from ..model.kv_shift import plan_shift, shift_caches, shift_due
from ..model.transformer import Attend, rms_norm, rope_table
from ..store import Decoder, Kernels, select_backend
from ..xp import to_numpy
from .constraint import Constraint
from .logprobs import TokenLogprob, token_logprob
from .options import Options
from .stop_text import StopText
from .sampling import Sampler

Array = Any


class LayerSource(Protocol):
    """Where the loop finds each layer's weights and KV cache."""

    n_ctx: int
    xp: ModuleType                      # the array module the request computes in
    outer: OuterWeights                 # the weights outside the layer stack, placed for xp
    attend_kernels: Kernels | None      # attention of one-token rows through Kernels.attend, when given

    def begin(self, pos: int, n_tokens: int) -> None:
        """A forward pass over positions pos..pos+n_tokens is about to run through every layer."""

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        """Layer i's weights, K cache and V cache [n_ctx, n_head_kv, head_dim], ready to compute."""

    def done(self, i: int) -> None:
        """Layer i has computed (its new KV rows are written in the arrays `layer` gave)."""

    def decode_step(self, positions: Sequence[int], x: Array, per_layer: Array | None = None) -> np.ndarray:
        """One token of this source's sequence at each of `positions` (one) through every layer and the
        output in one native call (x: float32 [1, n_embd], its embedding; `per_layer`: Gemma 4's per-layer
        inputs of it [1, n_layer, n_embd_per_layer]): float32 logits [1, n_vocab]."""

    def shift_context(self, n_keep: int, n_discard: int, n_past: int) -> None:
        """Every layer's caches of a context of n_past shifted (model.kv_shift.shift_caches)."""


class KernelAttention:
    """The model's Attend (transformer.Attend) over `kernels`: pebble_attend and pebble_attend_prompt."""

    def __init__(self, kernels: Kernels):
        self.kernels = kernels

    def tokens(self, cfg, q, caches, n_pos, new):
        return self.kernels.attend(q, caches, n_pos, cfg.n_head_kv, cfg.query_scale, cfg.attn_softcap, new)

    def chunk(self, cfg, q, cache, n_pos, sinks=None):
        return self.kernels.attend_prompt(q, cache, n_pos - q.shape[0], cfg.n_head_kv, cfg.query_scale,
                                          cfg.attn_softcap, cfg.window, sinks)


def attend_through(kernels: Kernels | None) -> Attend | None:
    """The model's `attend` (transformer.layer_forward) over `kernels`' attention, or None."""
    return KernelAttention(kernels) if kernels is not None else None


class ResidentLayers:
    """Every layer's weights and KV cache held in memory for the whole request (no store), computed
    by `kernels` in their array module (default: the selected backend's kernels for numpy arrays)."""

    def __init__(self, model: Model, n_ctx: int, kernels: Kernels | None = None, kv_type: str | None = None):
        kernels = kernels or select_backend().host_kernels
        self.kernels, self.cfg = kernels, model.config
        self.attend_kernels = kernels if kernels.attends else None
        self.xp = kernels.xp
        self.weights = model.resident_layers(kernels)
        self.outer = model.outer_weights(kernels)
        self.kv = KVCache.allocate(model.config, n_ctx, self.xp, kv_type)  # kv_type, else the server's
        self.n_ctx = n_ctx
        self._decoder: Decoder | None = None

    def decode_step(self, positions: Sequence[int], x: Array, per_layer: Array | None = None) -> np.ndarray:
        if self._decoder is None:
            self._decoder = self.kernels.decoder(self.cfg, self.weights, [[kv] for kv in zip(self.kv.k, self.kv.v)],
                                                 self.outer, self.n_ctx)
        return self._decoder.step([0], positions, x, per_layer=per_layer)

    def begin(self, pos: int, n_tokens: int) -> None:
        pass

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        return self.weights[i], self.kv.k[i], self.kv.v[i]

    def shift_context(self, n_keep: int, n_discard: int, n_past: int) -> None:
        for i in range(self.cfg.n_layer):
            if self.cfg.owns_kv(i):  # a layer reading another's caches (Gemma 4) has none to shift
                shift_caches(self.cfg.for_layer(i), self.kv.k[i], self.kv.v[i], n_keep, n_discard, n_past)

    def done(self, i: int) -> None:
        pass


@dataclass
class GenerationStats:
    """What one request cost, in Ollama's terms."""

    prompt_tokens: int = 0             # the prompt tokens processed (not those found in the cache)
    cached_tokens: int = 0             # the prompt tokens whose K and V were already in the cache
    cache_restored: int = 0            # ... of them, those brought back from the host tier (a parked conversation)
    prompt_ns: int = 0
    generated_tokens: int = 0
    generate_ns: int = 0
    done_reason: str | None = None     # "stop" (end of generation or a stop string) or "length"
    context_shifts: int = 0            # times a full context was shifted to go on (model/kv_shift.py)


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
        self.layers = layers if layers is not None else ResidentLayers(model, options.num_ctx, kv_type=options.kv_type)
        self.xp, self.outer = self.layers.xp, self.layers.outer
        self.sampler = Sampler(options)
        self.should_stop = should_stop or (lambda: False)
        self.prompt: list[int] = []
        self.history: list[int] = []   # prompt and generated tokens: what the repeat penalties look at
        self.generated: list[int] = []
        self.logits: np.ndarray | None = None  # what the next token is sampled from
        self.pos = 0
        self.shifts: list[tuple[int, int]] = []  # (kept, dropped) of each context shift, in order
        self.stats = GenerationStats()
        self.layer_cfgs = [self.cfg.for_layer(i) for i in range(self.cfg.n_layer)]
        self.attend = attend_through(getattr(self.layers, "attend_kernels", None))

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens through every layer at the current position; float32 logits of the last one. A single
        token (a decode step) is one call of the source's decoder."""
        if len(tokens) == 1:
            # float32 from the table to the step (on the GPU one copy, not rounded through the compute type)
            x = self.xp.ascontiguousarray(embed(self.outer, tokens, self.xp, self.cfg.embd_scale, np.float32))
            per_layer = per_layer_inputs(self.cfg, self.outer, tokens, x)            # Gemma 4's, else None
            logits = self.layers.decode_step([self.pos], x, per_layer)
            self.pos += 1
            return to_numpy(logits[0])
        x = self._through_layers(tokens)                                           # [T, n_embd]
        return to_numpy(output_logits(self.cfg, self.outer, x[-1]))               # [n_vocab]

    def _through_layers(self, tokens: Sequence[int]) -> Any:
        x = embed(self.outer, tokens, self.xp, self.cfg.embd_scale)                # [T, n_embd]
        per_layer = per_layer_inputs(self.cfg, self.outer, tokens, x)            # Gemma 4's, else None
        shared = {} if self.cfg.n_layer_kv else None                             # ... and its shared caches
        self.layers.begin(self.pos, len(tokens))
        experts = getattr(self.layers, "experts", lambda i: None)  # where a layer's experts come from
        for i, cfg in enumerate(self.layer_cfgs):
            weights, k_cache, v_cache = self.layers.layer(i)
            rope = tuple(t[self.pos:self.pos + len(tokens)] for t in rope_table(cfg, self.layers.n_ctx, self.xp))
            x = layer_forward(cfg, x, weights, k_cache, v_cache, self.pos, rope, self.attend, experts(i),
                              None if per_layer is None else per_layer[:, i], shared)
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

    # -- a generation one step at a time (what a batch drives): start, then next_token and wants_forward
    # for each token, the logits of the next one given by decode_one or by a batched step

    def start(self, prompt: Sequence[int], cached: int = 0) -> None:
        """Checks and prefills the prompt; `cached`: how many leading prompt tokens the layers' KV caches
        already hold (a conversation going on), so only the rest is prefilled."""
        self.logits = self.prefill(self.begin(prompt, cached))

    def begin(self, prompt: Sequence[int], cached: int = 0) -> list[int]:
        """`start` without the prefill: checks the prompt and takes it as this generation's; returns the
        tokens still to run (a batch prefills them together with other sequences': batch.prefill_batch)."""
        prompt = list(prompt)
        self._check_prompt(prompt)
        if not 0 <= cached < len(prompt):
            raise OptionsError(f"{cached} cached tokens of a {len(prompt)}-token prompt: at least its last "
                               "token must run")
        self.prompt, self.history = list(prompt), prompt
        self.pos = self.stats.cached_tokens = cached
        return prompt[cached:]

    def next_token(self) -> int | None:
        """The next token sampled from the current logits, or None when the generation is over (its
        done_reason says why: the end of generation, num_predict reached, or cancelled)."""
        limit = self.options.predict_limit
        if limit is not None and limit <= self.stats.generated_tokens:
            self.stats.done_reason = "length"
            return None
        start = time.perf_counter_ns()
        logits = raw = self.logits
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = self.sample(logits, self.history)
        if self.constraint is not None and token not in self.model.tokenizer.eog_ids:
            self.constraint.accept(token)
        self.stats.generate_ns += time.perf_counter_ns() - start
        if token in self.model.tokenizer.eog_ids:
            self.stats.done_reason = "stop"
            return None
        if self.should_stop():  # checked per token, before the token is used
            self.stats.done_reason = "cancelled"
            return None
        if self.logprobs is not None:  # of the raw logits, before any penalty or mask
            self.logprobs.append(token_logprob(raw, token, self.top_logprobs))
        self.stats.generated_tokens += 1
        self.generated.append(token)
        self.history.append(token)
        return token

    def wants_forward(self) -> bool:
        """After a token: whether it must run through the layers for the next one; if not, the generation
        is over (done_reason set). No forward pass runs for a token that will not be sampled."""
        if self.constraint is not None and self.constraint.stopped:
            self.stats.done_reason = "stop"  # the grammar is complete: only an end could follow
            return False
        if self.stats.generated_tokens == self.options.predict_limit:
            self.stats.done_reason = "length"
            return False
        if shift_due(self.pos, self.layers.n_ctx):
            self._shift_context()
        if self.pos >= self.layers.n_ctx:  # full, and it could not shift
            self.stats.done_reason = "length"
            return False
        return True

    def _shift_context(self) -> None:
        """The context shifted before the next token, as llama.cpp's server (which Ollama runs) shifts it: the
        first num_keep positions (and the BOS the model adds) kept, half of the rest dropped
        (model/kv_shift.py). Not for num_predict -2 or a request's `shift` false, nor where the source cannot
        shift or a sliding layer's ring would no longer hold what its window then needs."""
        shift = getattr(self.layers, "shift_context", None)
        if not self.options.shifts or shift is None:
            return
        tok, n_ctx = self.model.tokenizer, self.layers.n_ctx
        n_keep = self.options.num_keep + int(tok.add_bos and tok.bos_id is not None)
        amount = plan_shift(self.pos, n_keep, n_ctx, (self.cfg.kv_rows(i, n_ctx) for i in range(self.cfg.n_layer)))
        if amount is None:
            return
        shift(*amount, self.pos)
        self.shifts.append(amount)
        self.pos -= amount[1]
        self.stats.context_shifts += 1

    def tokens(self, prompt: Sequence[int], cached: int = 0) -> Iterator[int]:
        """Generated token ids, until end of generation, num_predict or a full context. `cached`: how many
        leading prompt tokens the layers' KV caches already hold (a conversation going on); only the
        rest is prefilled."""
        self.start(prompt, cached)
        while True:
            token = self.next_token()
            if token is None:
                return
            yield token
            if not self.wants_forward():
                return
            start = time.perf_counter_ns()
            self.logits = self.decode_one(token)
            self.stats.generate_ns += time.perf_counter_ns() - start

    def forwarded(self) -> list[int]:
        """The tokens whose K and V the caches now hold, in position order (less those a shift dropped)."""
        tokens = self.prompt + self.generated
        for keep, drop in self.shifts:
            tokens = tokens[:keep] + tokens[keep + drop:]
        return tokens[:self.pos]

    def text(self, prompt: Sequence[int], cached: int = 0) -> Iterator[str]:
        """Generated text as it comes: whole characters only, cut before the first stop string."""
        cutter = StopText(self.model.tokenizer, self.options.stop)
        tokens = self.tokens(prompt, cached)
        try:
            for token in tokens:
                piece = cutter.push(token)
                if cutter.stopped:
                    self.stats.done_reason = "stop"
                    tokens.close()
                if piece:
                    yield piece
                if cutter.stopped:
                    return
        finally:
            tokens.close()
        piece = cutter.finish()
        if cutter.stopped:
            self.stats.done_reason = "stop"
        if piece:
            yield piece

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

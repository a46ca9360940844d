"""The decode step's structs as Python (pebble.h's pebble_layer_shape, pebble_step_layer, pebble_step_model:
LayerShape, StepLayer, StepModel), the Decoder that steps one, and its making from a model's config, weights
and caches (make_decoder, which Kernels.decoder calls); when a step runs as a CUDA graph (GraphPolicy, for
the backends that have none and for the tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import InvalidArgumentError
from ..ggml_types import DENSE_TYPES
from ..kv_types import KV_TYPES, cache_kv_type
from .abi import ACTIVATIONS, DECODE_WEIGHTS, DECODER_GRAPHS, GATINGS


@dataclass(frozen=True)
class LayerShape:
    """struct pebble_layer_shape: what the decode step needs of a model's config."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_dims: int
    rope_neox: int
    rms_eps: float
    activation: int = 0          # 0 SwiGLU, 1 GELU-tanh (the Gemmas), 2 gpt-oss's clamped SwiGLU (its experts)
    ring: int = 0                # the caches are rings of a sliding window's rows
    attn_softcap: float = 0.0    # gemma2's soft cap of the scores; 0: none
    residual_scale: float = 1.0  # Granite's
    n_expert: int = 0            # experts in place of the FFN (pyplugin.model.moe); 0: a dense FFN
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0          # the shared expert's hidden size; 0: none
    expert_norm: int = 0
    expert_scale: float = 1.0
    expert_gating: int = 0       # 0 a softmax over every expert, 1 over the chosen experts' scores (gpt-oss)
    kv_layer: int = -1           # Gemma 4: the earlier layer whose caches this one reads; -1: its own
    v_norm: int = 0              # Gemma 4: V RMS-normed without a weight before it is cached

    @classmethod
    def of(cls, cfg) -> "LayerShape":
        """From a pyplugin.model.ModelConfig: a layer's own (ModelConfig.for_layer), whose window says
        whether its caches are rings (they hold min(n_ctx, window) rows: ModelConfig.kv_rows)."""
        if cfg.activation not in ACTIVATIONS:
            raise InvalidArgumentError(f"decoder: activation {cfg.activation!r}; {', '.join(ACTIVATIONS)} are "
                                       "computed")
        return cls(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.rope_dims,
                   int(cfg.rope_mode == "neox"), cfg.rms_eps, ACTIVATIONS.index(cfg.activation), int(cfg.window > 0),
                   cfg.attn_softcap, cfg.residual_scale, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp,
                   int(cfg.expert_norm), cfg.expert_scale, GATINGS.index(cfg.expert_gating), cfg.kv_from,
                   int(cfg.v_norm))


@dataclass(frozen=True)
class StepLayer:
    """struct pebble_step_layer: one layer as a decoder holds it. `weights` maps pebble_layer_weights fields
    to (GGUF type, buffer), absent ones left out; rope_cos and rope_sin are float32 [rope_rows, head_dim]."""

    shape: LayerShape
    weights: dict
    rope_cos: Any
    rope_sin: Any
    kv_rows: int
    attn_scale: float
    # A streamed layer: field name -> the store entry of that weight (its `weights` give the types; their
    # buffers are not read), its caches the entries kv_ids names; copied into the decoder's slots each step.
    streamed: dict | None = None
    # Experts as pebbles: (entry id of expert 0, experts cached), expert j the store entry id + j (its gate,
    # up and down rows; `weights` give their types only); None: the merged tensors of `weights`.
    experts: tuple | None = None


@dataclass(frozen=True)
class StepModel:
    """struct pebble_step_model: what a decoder holds beside its layers."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_seq: int
    kv_type: int
    rms_eps: float
    logit_scale: float
    final_softcap: float
    output_norm: tuple   # (GGUF type, buffer)
    output: tuple
    graphs: bool = True  # capture a batch stepped twice running as a CUDA graph (see pebble_decoder_stats)
    store: Any = None    # the streamed layers' entries (a Store of this library's backend)
    kv_ids: tuple = ()   # per sequence, the (K, V) entry ids of its caches in every layer
    slots: tuple = ()    # the streamed layers' two slots (buffers of the library's memory), or () for its own
    expert_store: Any = None  # the experts' entries (StepLayer.experts), or None for `store`'s
    expert_policy: int = 0    # a cache of experts' victim: EXPERT_POLICIES' index (pebble_step_model)
    expert_prefetch: bool = False  # each layer's router guesses its experts from the hidden state entering it
    n_embd_per_layer: int = 0      # Gemma 4's per-layer inputs' width: the step's x carries them (Decoder.step)


DECODER_STATS = ("steps", "tokens", "layer_passes", "graphs_captured", "graph_replays", "graphs_dropped",
                 "expert_hits", "expert_misses", "expert_bytes_restored", "expert_guesses", "expert_guesses_right",
                 "expert_prefetches", "expert_prefetch_hits", "expert_device_bytes", "scratch_bytes")
EXPERT_POLICIES = ("lru", "lfu")  # pebble_step_model.expert_policy 0 and 1: least recently / least often used
EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # what experts as pebbles take from the store


class GraphPolicy:
    """When a decode step runs as a CUDA graph (native/cuda/graph.cu's graph_policy, for the backends that have
    no graphs and for the tests): a batch (its sequences in order, and whether it makes logits) stepped twice
    running is captured; a batch that has a graph replays it; any other runs directly. Up to DECODER_GRAPHS
    graphs are kept, the least recently used dropped first."""

    def __init__(self, enabled: bool):
        self.enabled, self.last_direct, self.slots = enabled, None, {}  # slots: key -> last use
        self.clock = self.captured = self.replays = self.dropped = 0

    def decide(self, key) -> str:
        """'direct', 'capture' or 'replay' for a step of this key."""
        self.clock += 1
        if not self.enabled:
            return "direct"
        if key in self.slots:
            self.slots[key] = self.clock
            self.replays += 1
            return "replay"
        if self.last_direct == key:
            if len(self.slots) == DECODER_GRAPHS:
                del self.slots[min(self.slots, key=self.slots.get)]
                self.dropped += 1
            self.last_direct = None
            self.slots[key] = self.clock
            self.captured += 1
            return "capture"
        self.last_direct = key
        return "direct"


def tensor_ref(name: str, t) -> tuple:
    """(GGUF type, buffer) of a QuantWeight or a dense float32/float16 array, as the decoder takes them."""
    if hasattr(t, "qtype"):  # a QuantWeight
        return t.qtype, t.data
    if t.dtype in DENSE_TYPES:
        return DENSE_TYPES[t.dtype], t
    raise InvalidArgumentError(f"decoder: {name} is {t.dtype}; dense weights must be float32 or float16")


class Decoder:
    """A model's decode step as one call (pebble_decoder_*): made once over a plan's weights and caches,
    then `step` runs one token of each of up to n_seq sequences through every layer and the output."""

    def __init__(self, lib_decoder, xp, n_embd: int, n_vocab: int, stream: Callable[[], Any], n_layer: int = 0,
                 n_embd_per_layer: int = 0):
        self._decoder, self.xp, self.n_embd, self.n_vocab, self._stream = lib_decoder, xp, n_embd, n_vocab, stream
        self.n_layer, self.n_embd_per_layer = n_layer, n_embd_per_layer
        self.calls = 0  # native calls made by steps: one each

    def step(self, seqs, positions, x, logits: bool = True, per_layer=None):
        """Token b is sequence seqs[b] at positions[b]; x (float32 [n, n_embd], their embeddings) becomes
        their last hidden states in place. `per_layer`: Gemma 4's per-layer inputs of the tokens [n, n_layer,
        n_embd_per_layer] (model.gemma4.per_layer_inputs), which the model's layers need; they travel after x
        in the step's buffer (pebble_decoder_step). Returns float32 logits [n, n_vocab], or None when not wanted."""
        xp, n = self.xp, len(seqs)
        out = xp.empty((n, self.n_vocab), dtype=np.float32) if logits else None
        if bool(self.n_embd_per_layer) != (per_layer is not None):
            raise InvalidArgumentError(f"decoder step: per-layer inputs {'missing' if per_layer is None else 'given'}; "
                                       f"the model's per-layer width is {self.n_embd_per_layer}")
        buffer = x
        if per_layer is not None:
            if tuple(per_layer.shape) != (n, self.n_layer, self.n_embd_per_layer):
                raise InvalidArgumentError(f"decoder step: per-layer inputs of shape {tuple(per_layer.shape)}; "
                                           f"{(n, self.n_layer, self.n_embd_per_layer)} are needed")
            buffer = xp.concatenate([xp.asarray(x, dtype=np.float32).reshape(-1),
                                     xp.asarray(per_layer, dtype=np.float32).reshape(-1)])
        self._decoder.step(seqs, positions, buffer, out, stream=self._stream())
        if buffer is not x:
            x[...] = buffer[:x.size].reshape(x.shape)
        self.calls += 1
        return out

    def stats(self) -> dict:
        return self._decoder.stats()

    def close(self) -> None:
        self._decoder.close()


def make_decoder(kernels, cfg, layers, caches, outer, n_ctx: int, *, streamed=None, store=None, kv_ids=(),
            slots=(), experts=None, expert_store=None, expert_policy: str = "lru",
            expert_prefetch: bool = False) -> Decoder:
    """The decode step of a model over these weights and caches (pebble_decoder_create): `cfg` its
    ModelConfig, `layers` each layer's LayerWeights, caches[i][s] layer i's (K, V) of sequence s (each
    [rows, n_head_kv, head_dim] in a KV type: kv_types.py), `outer` its OuterWeights, `n_ctx` the context its
    RoPE tables cover. Every array must live as long as the decoder; the Decoder keeps them.
    `streamed`: {layer: {field: entry id}} for the layers copied from `store` into the decoder's slots
    each step (their `layers` and `caches` give types and shapes only), each sequence's caches the
    entries kv_ids[s] = (K id, V id); `slots` the two buffers they are copied into (equal sizes), or ()
    for the decoder to make its own. `experts`: {layer: (ids, experts cached)} for layers whose experts
    are pebbles (their merged matrices in `layers` give types only): ids the entry of expert 0, an entry
    each, of `expert_store` or else `store` (experts_stored 1), or the entries of the merged gate, up and
    down tensors in `store` (2); `expert_policy` and `expert_prefetch` as pebble_step_model has them."""
    from ..model.transformer import rope_table  # noqa: PLC0415 - the store sits below the model
    kv_type = _kv_type("decoder", caches[0][0][0], cfg.for_layer(0).head_dim)
    step_layers = []
    for i, lw in enumerate(layers):
        lcfg = cfg.for_layer(i)
        cos, sin = (kernels.xp.ascontiguousarray(t.reshape(n_ctx, -1)) for t in rope_table(lcfg, n_ctx, kernels.xp,
                                                                                       np.float32))
        rows = caches[i][0][0].shape[0]
        if lcfg.window and rows > lcfg.window:
            raise InvalidArgumentError(f"decoder: layer {i} slides over {lcfg.window} positions, so its caches "
                                       f"hold that many rows (a ring), not {rows}")
        stored = (experts or {}).get(i)
        if stored is not None and isinstance(stored[0], tuple) and len(stored[0]) != len(EXPERT_MATRICES):
            raise InvalidArgumentError(f"decoder: layer {i}: experts read from merged tensors need the entries of "
                                       f"{', '.join(EXPERT_MATRICES)}; got {len(stored[0])}")
        refs = {name: tensor_ref(name, getattr(lw, name)) for name in DECODE_WEIGHTS if getattr(lw, name) is not None}
        if stored is not None:  # types only: the experts come from the store
            refs.update({name: (refs[name][0], None) for name in EXPERT_MATRICES if name in refs})
        step_layers.append(StepLayer(LayerShape.of(lcfg), refs, cos, sin, rows, float(np.float32(lcfg.query_scale)),
                                     (streamed or {}).get(i), None if stored is None else tuple(stored)))
    output_norm = kernels.xp.ascontiguousarray(outer.output_norm, dtype=np.float32)
    model = StepModel(cfg.n_layer, cfg.n_embd, cfg.n_vocab, len(caches[0]), kv_type, cfg.rms_eps,
                      float(cfg.logit_scale), float(cfg.final_softcap), tensor_ref("output_norm", output_norm),
                      tensor_ref("output", outer.output),
                      graphs=os.environ.get("PEBBLING_CUDA_GRAPHS", "1") != "0", store=store,
                      kv_ids=tuple(tuple(pair) for pair in kv_ids), slots=tuple(slots), expert_store=expert_store,
                      expert_policy=EXPERT_POLICIES.index(expert_policy), expert_prefetch=bool(expert_prefetch),
                      n_embd_per_layer=cfg.n_embd_per_layer)
    k_caches = [k for per_layer in caches for k, _ in per_layer]
    v_caches = [v for per_layer in caches for _, v in per_layer]
    return Decoder(kernels.lib.decoder(model, step_layers, k_caches, v_caches), kernels.xp, cfg.n_embd, cfg.n_vocab,
                   kernels._stream, cfg.n_layer, cfg.n_embd_per_layer)


def _kv_type(call: str, cache, head_dim: int) -> int:
    """The GGUF type id of a cache's KV type (kv_types.py), or an error naming what was seen."""
    try:
        return cache_kv_type(cache, head_dim).ggml_type
    except ValueError as exc:
        raise InvalidArgumentError(f"{call}: {exc}; accepted: float16 (f16), float32 (f32), or uint8 blocks of "
                                   f"{' or '.join(t.name for t in KV_TYPES.values() if t.quantized)}") from None

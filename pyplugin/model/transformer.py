"""The decoder-only transformer forward pass, written once for numpy and CuPy.

Everything here is a pure function of a config, arrays and a position: the model does not own the
layer loop, so a caller may hand ``layer_forward`` each layer's weights from wherever they live
(all resident, or streamed through device memory one layer at a time).

Layouts follow llama.cpp: a weight matrix is [out_features, in_features] (GGUF's ne reversed) and
y = x @ W.T, whether W is a dense array or a ``QuantWeight`` still in its GGUF type. For ``llama`` the
converter permuted the Q/K rows of each head so that GGML's "normal" RoPE mode, which rotates
adjacent pairs (2i, 2i+1), matches the original model; qwen2, qwen3, phi3 and the Gemmas keep the Hugging
Face order and use NeoX mode, which rotates (i, i + n_rot/2).

One block serves every architecture; what differs is optional and read from the config or the layer's
weights: per-head RMS norms on Q and K (qwen3, gemma3), norms after attention and after the FFN (the
Gemmas' "sandwich"), a GELU-tanh gate instead of SiLU (the Gemmas), a scaled embedding, residual and
logits (the Gemmas, Granite), soft-capped attention scores and logits (gemma2), and sliding-window
layers (Mistral, the Gemmas, gpt-oss) with their own RoPE base; a learned sink logit per head in the
softmax and a bias on the output projection (gpt-oss); a mixture of experts in place of the FFN
(pyplugin.model.moe). A sliding layer's KV cache is a ring of its
window's rows: position p lives in row p % rows, so a 32k context keeps only the window on those layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from ..kv_types import KVType, cache_kv_type, decode, default_kv_type, encode, kv_type
from ..xp import compute_dtype, get_array_module
from .attention import attention, by_rows, softcap
from .config import ModelConfig
from .rope import ROPE_NEOX, ROPE_NORMAL, apply_rope, rope_inv_freq, rope_table, yarn_corr_dims  # noqa: F401
from .moe import moe_ffn
from .qweight import QuantWeight

Array = Any  # numpy.ndarray or cupy.ndarray

@dataclass
class LayerWeights:
    """One layer's arrays, the same fields for every architecture."""

    attn_norm: Array            # [n_embd]
    wq: Array                   # [n_head * head_dim, n_embd]
    wo: Array                   # [n_embd, n_head * head_dim]
    ffn_norm: Array             # [n_embd]
    wk: Array | None = None     # [n_head_kv * head_dim, n_embd]; None where the layer reads another's caches
    wv: Array | None = None     # [n_head_kv * head_dim, n_embd]; None there, and where V is K's projection (Gemma 4)
    w_gate: Array | None = None  # [n_ff, n_embd]; None in a layer of experts
    w_up: Array | None = None    # [n_ff, n_embd]
    w_down: Array | None = None  # [n_embd, n_ff]
    bq: Array | None = None     # [n_head * head_dim]   (qwen2)
    bk: Array | None = None     # [n_head_kv * head_dim]
    bv: Array | None = None     # [n_head_kv * head_dim]
    q_norm: Array | None = None  # [head_dim]  per-head RMS norm of Q (qwen3, gemma3)
    k_norm: Array | None = None  # [head_dim]  ... of K
    post_attn_norm: Array | None = None  # [n_embd]  on the attention's output (the Gemmas)
    post_ffn_norm: Array | None = None   # [n_embd]  on the FFN's output (the Gemmas)
    # experts (pyplugin.model.moe): the router, and the merged expert matrices as stacks of rows
    ffn_gate_inp: Array | None = None    # [n_expert, n_embd]
    ffn_gate_exps: Array | None = None   # [n_expert * n_ff_exp, n_embd]
    ffn_up_exps: Array | None = None     # [n_expert * n_ff_exp, n_embd]
    ffn_down_exps: Array | None = None   # [n_expert * n_embd, n_ff_exp]
    ffn_gate_inp_shexp: Array | None = None  # [n_embd]  the shared expert's gate (qwen2moe)
    ffn_gate_shexp: Array | None = None  # [n_ff_shexp, n_embd]
    ffn_up_shexp: Array | None = None    # [n_ff_shexp, n_embd]
    ffn_down_shexp: Array | None = None  # [n_embd, n_ff_shexp]
    # gpt-oss: a sink logit per head (attention.attention), the output projection's bias, the router's, and
    # each expert's gate, up and down biases as stacks (expert j's are rows j * rows .. (j + 1) * rows)
    attn_sinks: Array | None = None      # [n_head]
    bo: Array | None = None              # [n_embd]
    ffn_gate_inp_b: Array | None = None  # [n_expert]
    ffn_gate_exps_b: Array | None = None  # [n_expert * n_ff_exp]
    ffn_up_exps_b: Array | None = None   # [n_expert * n_ff_exp]
    ffn_down_exps_b: Array | None = None  # [n_expert * n_embd]
    # Gemma 4 (pyplugin.model.gemma4): the per-layer embedding's gate, projection and norm; the layer's output
    # scale; beside its experts a dense FFN (w_gate, w_up, w_down), the router's input scale, the norms before the
    # experts and after each half, and a scale per expert on its output
    per_layer_inp_gate: Array | None = None   # [n_embd_per_layer, n_embd]
    per_layer_proj: Array | None = None       # [n_embd, n_embd_per_layer]
    per_layer_post_norm: Array | None = None  # [n_embd]
    out_scale: Array | None = None            # [1]
    ffn_gate_inp_s: Array | None = None       # [n_embd]
    ffn_pre_norm_2: Array | None = None       # [n_embd]
    ffn_post_norm_1: Array | None = None      # [n_embd]
    ffn_post_norm_2: Array | None = None      # [n_embd]
    ffn_down_exps_s: Array | None = None      # [n_expert]

    def arrays(self) -> Iterator[tuple[str, Array]]:
        """(field name, array) for every array present."""
        for f in fields(self):
            a = getattr(self, f.name)
            if a is not None:
                yield f.name, a

    def map(self, fn: Callable[[Array], Array]) -> "LayerWeights":
        """A copy with ``fn`` applied to every array, e.g. to move it to the device."""
        return replace(self, **{name: fn(a) for name, a in self.arrays()})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.arrays())


@dataclass
class OuterWeights:
    """The weights outside the layer stack."""

    token_embd: Array           # [n_vocab, n_embd]; rows are gathered on the array's own side
    output_norm: Array          # [n_embd]
    output: Array               # [n_vocab, n_embd]; token_embd itself when the model ties them
    # Gemma 4's per-layer embeddings (pyplugin.model.gemma4.per_layer_inputs), or None
    per_layer_token_embd: Array | None = None  # [n_vocab, n_layer * n_embd_per_layer]; rows gathered on its side
    per_layer_model_proj: Array | None = None  # [n_layer * n_embd_per_layer, n_embd]
    per_layer_proj_norm: Array | None = None   # [n_embd_per_layer]


@dataclass
class KVCache:
    """Keys and values of every layer, allocated up front for ``n_ctx`` positions."""

    k: list[Array]              # per layer [rows, n_head_kv, width]: n_ctx rows, a sliding layer its window
    v: list[Array]              # per layer [rows, n_head_kv, width] (width: head_dim, or a block type's bytes)

    @classmethod
    def allocate(cls, cfg: ModelConfig, n_ctx: int, xp: Any = np, kv: KVType | str | None = None) -> "KVCache":
        """Caches of KV type `kv` (a name or a KVType; default the server's, kv_types.default_kv_type).
        A layer that reads an earlier layer's caches (Gemma 4's, ModelConfig.kv_source) is given that layer's
        arrays: it keeps none of its own."""
        kv = kv if isinstance(kv, KVType) else kv_type(kv or default_kv_type(cfg.head_dim))
        k, v = [], []
        for i in range(cfg.n_layer):
            lcfg, src = cfg.for_layer(i), cfg.kv_source(i)
            if src != i:
                k.append(k[src]), v.append(v[src])
                continue
            kv.check_head_dim(lcfg.head_dim)
            shape = kv.shape(cfg.kv_rows(i, n_ctx), lcfg.n_head_kv, lcfg.head_dim)
            k.append(xp.zeros(shape, kv.dtype)), v.append(xp.zeros(shape, kv.dtype))
        return cls(k, v)

    @property
    def nbytes(self) -> int:
        return sum({id(a): a.nbytes for a in self.k + self.v}.values())  # a shared layer's arrays counted once


# ---------------------------------------------------------------------------------------------------
# building blocks


def linear(x: Array, w: Array | QuantWeight, b: Array | None = None) -> Array:
    """x @ w.T (+ b); w a dense array, or a matrix in its GGUF form (computed by its kernels)."""
    y = w.matmul(x) if isinstance(w, QuantWeight) else x @ w.T
    return y if b is None else y + b


@by_rows(0)
def rms_norm(x: Array, w: Array | None, eps: float) -> Array:
    """x over the root mean square of its last axis, times `w` (None: no weight, Gemma 4's V and router)."""
    # In float32 whatever the compute type: a float16 sum of squares overflows on real activations.
    xf = x.astype(np.float32, copy=False)
    xp = get_array_module(x)
    scale = 1.0 / xp.sqrt((xf * xf).mean(axis=-1, keepdims=True) + eps)
    return (xf * scale if w is None else xf * scale * w).astype(x.dtype, copy=False)


@by_rows(0)
def silu(x: Array) -> Array:
    """x / (1 + exp(-x)), in one new array (a prefill's gate is large: each temporary costs a pass
    and, on the host, the page faults of a fresh allocation)."""
    xp = get_array_module(x)
    t = -x
    xp.exp(t, out=t)
    t += 1.0
    return xp.divide(x, t, out=t)


_GELU_C = math.sqrt(2.0 / math.pi)


@by_rows(0)
def gelu_tanh(x: Array) -> Array:
    """GELU's tanh approximation, as GGML's gelu and Hugging Face's gelu_pytorch_tanh compute it."""
    xp = get_array_module(x)
    return 0.5 * x * (1.0 + xp.tanh(_GELU_C * (x + 0.044715 * x * x * x)))


def embed(outer: OuterWeights, tokens: Any, xp: Any = np, scale: float = 1.0, dtype: Any = None) -> Array:
    """Token ids -> x [T, n_embd] in `dtype` (default xp's compute type), times `scale` (the config's
    embd_scale). Rows are gathered where token_embd lives, so a host-side table sends only T rows to the
    device."""
    return table_rows(outer.token_embd, tokens, xp, scale, dtype)


def table_rows(table: Array | QuantWeight, tokens: Any, xp: Any = np, scale: float = 1.0, dtype: Any = None) -> Array:
    """The rows of `tokens` of a table (a token embedding; Gemma 4's per-layer one), gathered where it lives,
    times `scale`, as xp's `dtype` (default its compute type)."""
    if isinstance(table, QuantWeight):  # only the rows asked for are decoded
        rows = table.take_rows(tokens)
    else:
        rows = table[get_array_module(table).asarray(tokens, dtype=np.int64)]
    if scale != 1.0:
        rows = rows * np.float32(scale)
    return xp.asarray(rows, dtype=compute_dtype(xp) if dtype is None else dtype)


class Attend(Protocol):
    """The kernels' attention in place of ``attention`` (runtime.generation.KernelAttention), told the case:
    B sequences of a row each and one sequence's chunk of B rows are both q [B, n_head, head_dim]."""

    def tokens(self, cfg: ModelConfig, q: Array, caches: list, n_pos: list, new: tuple | None) -> Array:
        """A row per sequence: q [B, n_head, head_dim] rotated, over B (K, V) `caches` of n_pos[b] rows; `new`
        (k, v) [B, n_head_kv, head_dim] written into row n_pos[b] - 1 first (None: written). float32 [B, -1]."""

    def chunk(self, cfg: ModelConfig, q: Array, cache: tuple, n_pos: int, sinks: Array | None = None) -> Array:
        """One sequence's prompt chunk, its rows written: q [T, n_head, head_dim] rotated, the queries ending at
        row n_pos - 1 of `cache` (K, V), the layer's window applied, `sinks` (gpt-oss's) in each head's softmax.
        float32 [T, n_head * head_dim]."""


def layer_forward(cfg: ModelConfig, x: Array, lw: LayerWeights, k_cache: Array, v_cache: Array,
                  pos: int, rope: tuple[Array, Array] | None = None, attend: Attend | None = None,
                  experts: Any = None, per_layer: Array | None = None, shared: dict | None = None) -> Array:
    """One transformer block: ``attention_block`` then ``ffn_block`` (`experts`: moe.moe_ffn's), then Gemma 4's
    per-layer embedding (`per_layer`: this layer's inputs [T, n_embd_per_layer], gemma4.per_layer_inputs) and
    output scale. `shared`: one dict for a whole pass through the layers where layers share caches (Gemma 4)."""
    x = ffn_block(cfg, attention_block(cfg, x, lw, k_cache, v_cache, pos, rope, attend, shared), lw, experts)
    return layer_tail(cfg, x, lw, per_layer)


def layer_tail(cfg: ModelConfig, x: Array, lw: LayerWeights, per_layer: Array | None) -> Array:
    """What follows the FFN's residual in a Gemma 4 layer, where its weights have them: the per-layer embedding
    (`per_layer`: this layer's inputs [T, n_embd_per_layer]) and the output scale; x itself elsewhere."""
    if lw.per_layer_inp_gate is not None:
        gated = gelu_tanh(linear(x, lw.per_layer_inp_gate)) * per_layer                # [T, n_embd_per_layer]
        x = x + rms_norm(linear(gated, lw.per_layer_proj), lw.per_layer_post_norm, cfg.rms_eps)
    if lw.out_scale is not None:
        x = x * lw.out_scale.reshape(-1)[0]
    return x


def attention_block(cfg: ModelConfig, x: Array, lw: LayerWeights, k_cache: Array, v_cache: Array,
                    pos: int, rope: tuple[Array, Array] | None = None, attend: Attend | None = None,
                    shared: dict | None = None) -> Array:
    """The attention half of a transformer block on x [T, n_embd] at positions pos..pos+T; `cfg` is the layer's own
    (ModelConfig.for_layer).

    Writes the T new K/V rows into k_cache/v_cache [rows, n_head_kv, head_dim] and attends over the
    positions the layer sees. A cache of fewer rows than pos+T is a ring (a sliding layer's window):
    position p is row p % rows, and the keys still needed are read before the new ones are written.
    Returns the new x [T, n_embd]. `rope`: the (cos, sin) rows of these positions, each [T, 1, head_dim]
    as ``rope_table`` lays them out; None takes them from ``rope_table``. `attend`: the kernels' attention in
    place of ``attention``: `tokens` for one token on a layer without a window (its row written by that
    call), `chunk` for a prompt chunk (T > 1) on any layer whose cache is not a ring.

    A layer reading another's caches (cfg.kv_from, Gemma 4) computes no K or V and writes nothing: the caches
    are that layer's, written earlier in the pass; where they are a ring a chunk has overwritten, it attends over
    the rows that layer attended over, which that layer left in `shared` (keyed by the cache).
    """
    T = x.shape[0]
    xp = get_array_module(x)
    rows = k_cache.shape[0]
    ring = cfg.window and rows < pos + T
    if pos + T > rows and not (ring and rows >= cfg.window):
        raise ValueError(f"positions {pos}..{pos + T} do not fit a KV cache of {rows}")

    h = rms_norm(x, lw.attn_norm, cfg.rms_eps)                                  # [T, n_embd]
    q = linear(h, lw.wq, lw.bq).reshape(T, cfg.n_head, cfg.head_dim)           # [T, n_head, hd]
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, cfg.rms_eps)
    if rope is None:  # a table of a power of two positions, so that few are made
        rope = tuple(table[pos:pos + T] for table in rope_table(cfg, 1 << (pos + T - 1).bit_length(), xp))
    cos, sin = rope
    q = apply_rope(cfg, q, cos, sin)
    reader = cfg.kv_from >= 0
    if not reader:
        k = linear(h, lw.wk, lw.bk).reshape(T, cfg.n_head_kv, cfg.head_dim)    # [T, n_head_kv, hd]
        v = k if lw.wv is None else linear(h, lw.wv, lw.bv).reshape(T, cfg.n_head_kv, cfg.head_dim)
        if lw.k_norm is not None:
            k = rms_norm(k, lw.k_norm, cfg.rms_eps)
        if cfg.v_norm:
            v = rms_norm(v, None, cfg.rms_eps)
        k = apply_rope(cfg, k, cos, sin)
    # The caches hold their KV type (f16, or q8_0/q4_0 blocks); attention reads them back as x's dtype,
    # so it sees exactly what a later step will read.
    kv, dt = cache_kv_type(k_cache, cfg.head_dim), x.dtype
    if ring:
        lo = max(0, pos - cfg.window + 1)                  # the oldest position a query here sees
        if reader and T > 1:
            keys, values = shared[id(k_cache)]
        elif reader:                                       # one row: the ring still holds lo..pos
            at = xp.arange(lo, pos + 1) % rows
            keys, values = decode(k_cache[at], kv, dt), decode(v_cache[at], kv, dt)
        else:
            old = xp.arange(lo, pos) % rows
            k_rows, v_rows = encode(k, kv), encode(v, kv)
            keys = xp.concatenate([decode(k_cache[old], kv, dt), decode(k_rows, kv, dt)])
            values = xp.concatenate([decode(v_cache[old], kv, dt), decode(v_rows, kv, dt)])
            keep = min(T, rows)                            # the newest rows only: they fill the ring
            at = xp.arange(pos + T - keep, pos + T) % rows
            k_cache[at], v_cache[at] = k_rows[T - keep:], v_rows[T - keep:]
            if shared is not None:
                shared[id(k_cache)] = keys, values
        attn = attention(cfg, q, keys, values, pos, lo, lw.attn_sinks)
    else:
        if attend is not None and T == 1 and not cfg.window and lw.attn_sinks is None:  # the row written (encoded)
            # by the kernels' call (which has no sinks), or already there for a reader
            attn = attend.tokens(cfg, q, [(k_cache, v_cache)], [pos + 1], None if reader else (k, v))
        else:
            if not reader:
                k_cache[pos:pos + T], v_cache[pos:pos + T] = encode(k, kv), encode(v, kv)
            if attend is not None and T > 1:  # a prompt chunk: the kernels' attention over the rows written
                attn = attend.chunk(cfg, q, (k_cache, v_cache), pos + T, lw.attn_sinks)
            else:
                attn = attention(cfg, q, decode(k_cache[:pos + T], kv, dt), decode(v_cache[:pos + T], kv, dt), pos, 0,
                                 lw.attn_sinks)
    out = linear(attn, lw.wo, lw.bo)                                                 # [T, n_embd]
    if lw.post_attn_norm is not None:
        out = rms_norm(out, lw.post_attn_norm, cfg.rms_eps)
    return x + (out if cfg.residual_scale == 1.0 else out * cfg.residual_scale)


def ffn_block(cfg: ModelConfig, x: Array, lw: LayerWeights, experts: Any = None, max_rows: int = 0) -> Array:
    """The feed-forward half of a transformer block on x [T, n_embd], each row on its own; `experts` and
    `max_rows`: where the experts come from and how many rows go through a matrix at once (moe.moe_ffn).
    Gemma 4's layer of experts runs a dense FFN beside them, each half normed after, the experts on x normed by
    ffn_pre_norm_2 and routed by x normed without a weight, over sqrt(n_embd), times ffn_gate_inp_s."""
    h = rms_norm(x, lw.ffn_norm, cfg.rms_eps)
    act = gelu_tanh if cfg.activation == "gelu" else silu
    if lw.ffn_gate_inp is not None and lw.w_gate is not None:                   # Gemma 4: dense FFN and experts
        dense = rms_norm(_gated(h, lw, act), lw.ffn_post_norm_1, cfg.rms_eps)
        moe = moe_ffn(cfg, rms_norm(x, lw.ffn_pre_norm_2, cfg.rms_eps), lw, experts, max_rows, act,
                      router_input(cfg, x, lw))
        out = dense + rms_norm(moe.astype(x.dtype, copy=False), lw.ffn_post_norm_2, cfg.rms_eps)
    elif lw.ffn_gate_inp is not None:                                           # experts
        out = moe_ffn(cfg, h, lw, experts, max_rows).astype(x.dtype, copy=False)  # [T, n_embd]
    else:
        out = _gated(h, lw, act)                                                # [T, n_embd] gated FFN
    if lw.post_ffn_norm is not None:
        out = rms_norm(out, lw.post_ffn_norm, cfg.rms_eps)
    return x + (out if cfg.residual_scale == 1.0 else out * cfg.residual_scale)


def router_input(cfg: ModelConfig, x: Array, lw: LayerWeights) -> Array:
    """What a layer's router scores for x [T, n_embd]: x normed by ffn_norm; where the layer has its own router
    scale (Gemma 4's ffn_gate_inp_s), x normed without a weight, over sqrt(n_embd), times that scale."""
    if lw.ffn_gate_inp_s is None:
        return rms_norm(x, lw.ffn_norm, cfg.rms_eps)
    return rms_norm(x, None, cfg.rms_eps) * (lw.ffn_gate_inp_s / np.float32(math.sqrt(cfg.n_embd)))


def _gated(h: Array, lw: LayerWeights, act: Callable[[Array], Array]) -> Array:
    gated = act(linear(h, lw.w_gate))                                           # [T, n_ff]
    gated *= linear(h, lw.w_up)
    return linear(gated, lw.w_down)


def output_logits(cfg: ModelConfig, outer: OuterWeights, h: Array) -> Array:
    """Final norm and output projection: h [..., n_embd] -> float32 logits [..., n_vocab]."""
    h = rms_norm(h, outer.output_norm, cfg.rms_eps)
    logits = linear(h, outer.output).astype(np.float32, copy=False)
    if cfg.logit_scale != 1.0:
        logits = logits * np.float32(cfg.logit_scale)
    return softcap(logits, cfg.final_softcap)

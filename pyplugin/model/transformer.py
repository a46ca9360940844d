"""The decoder-only transformer forward pass, written once for numpy and CuPy.

Everything here is a pure function of a config, arrays and a position: the model does not own the
layer loop, so a caller may hand ``layer_forward`` each layer's weights from wherever they live
(all resident, or streamed through device memory one layer at a time).

Layouts follow llama.cpp: a weight matrix is [out_features, in_features] (GGUF's ne reversed) and
y = x @ W.T, whether W is a dense array or a ``QuantWeight`` still in its GGUF type. For ``llama`` the
converter permuted the Q/K rows of each head so that GGML's "normal" RoPE mode, which rotates
adjacent pairs (2i, 2i+1), matches the original model; qwen2 and phi3 keep the Hugging Face order and
use NeoX mode, which rotates (i, i + n_rot/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np

from ..xp import compute_dtype, get_array_module
from .qweight import QuantWeight

Array = Any  # numpy.ndarray or cupy.ndarray

ROPE_NORMAL, ROPE_NEOX = "normal", "neox"


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model and the constants its forward pass needs."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_mode: str                      # ROPE_NORMAL (llama) or ROPE_NEOX (qwen2, phi3)
    rope_dims: int                      # leading dims of each head that are rotated
    rope_theta: float = 10000.0
    rope_freq_scale: float = 1.0        # 1 / linear scaling factor
    rope_freq_factors: tuple[float, ...] | None = None  # llama3-style per-frequency divisors
    attn_scale: float | None = None     # multiplies q before the dot products; None: 1/sqrt(head_dim)
    pooling: str = "mean"               # how embeddings pool the hidden states: mean, cls, last, none, rank

    @property
    def n_group(self) -> int:
        """Query heads that share one KV head."""
        return self.n_head // self.n_head_kv

    @property
    def query_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """K and V of one token in one layer."""
        return 2 * self.n_head_kv * self.head_dim * itemsize


@dataclass
class LayerWeights:
    """One layer's arrays, the same fields for every architecture."""

    attn_norm: Array            # [n_embd]
    wq: Array                   # [n_head * head_dim, n_embd]
    wk: Array                   # [n_head_kv * head_dim, n_embd]
    wv: Array                   # [n_head_kv * head_dim, n_embd]
    wo: Array                   # [n_embd, n_head * head_dim]
    ffn_norm: Array             # [n_embd]
    w_gate: Array               # [n_ff, n_embd]
    w_up: Array                 # [n_ff, n_embd]
    w_down: Array               # [n_embd, n_ff]
    bq: Array | None = None     # [n_head * head_dim]   (qwen2)
    bk: Array | None = None     # [n_head_kv * head_dim]
    bv: Array | None = None     # [n_head_kv * head_dim]

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


@dataclass
class KVCache:
    """Keys and values of every layer, allocated up front for ``n_ctx`` positions."""

    k: list[Array]              # per layer [n_ctx, n_head_kv, head_dim]
    v: list[Array]              # per layer [n_ctx, n_head_kv, head_dim]

    @classmethod
    def allocate(cls, cfg: ModelConfig, n_ctx: int, xp: Any = np, dtype: Any = None) -> "KVCache":
        dtype = dtype or compute_dtype(xp)
        shape = (n_ctx, cfg.n_head_kv, cfg.head_dim)
        return cls([xp.zeros(shape, dtype) for _ in range(cfg.n_layer)],
                   [xp.zeros(shape, dtype) for _ in range(cfg.n_layer)])

    @property
    def n_ctx(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


# ---------------------------------------------------------------------------------------------------
# building blocks


def linear(x: Array, w: Array | QuantWeight, b: Array | None = None) -> Array:
    """x @ w.T (+ b); w a dense array, or a matrix in its GGUF form (computed by its kernels)."""
    y = w.matmul(x) if isinstance(w, QuantWeight) else x @ w.T
    return y if b is None else y + b


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    # In float32 whatever the compute type: a float16 sum of squares overflows on real activations.
    xf = x.astype(np.float32, copy=False)
    xp = get_array_module(x)
    scale = 1.0 / xp.sqrt((xf * xf).mean(axis=-1, keepdims=True) + eps)
    return (xf * scale * w).astype(x.dtype, copy=False)


def silu(x: Array) -> Array:
    xp = get_array_module(x)
    return x / (1.0 + xp.exp(-x))


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Angle per position of each rotated pair, as GGML computes it: scale * theta^(-2i/n) / factor."""
    i = np.arange(cfg.rope_dims // 2, dtype=np.float64)
    inv = cfg.rope_freq_scale * cfg.rope_theta ** (-2.0 * i / cfg.rope_dims)
    if cfg.rope_freq_factors is not None:
        inv = inv / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
    return inv


@lru_cache(maxsize=16)
def rope_table(cfg: ModelConfig, n_ctx: int, xp: Any, dtype: Any = None) -> tuple[Array, Array]:
    """cos and signed sin for every position and every dim of a head, each [n_ctx, 1, head_dim]
    (broadcast over heads), laid out for ``apply_rope``; dims past rope_dims get cos 1 and sin 0.
    Angles are float64, the table xp's compute type unless `dtype` says otherwise.

    Made once per config, context size, array module and dtype, so a decode step on the GPU uploads
    nothing.
    """
    positions = np.arange(n_ctx, dtype=np.float64)
    angles = positions[:, None] * rope_inv_freq(cfg)[None, :]              # [n_ctx, rope_dims/2]
    cos, sin = np.ones((n_ctx, cfg.head_dim)), np.zeros((n_ctx, cfg.head_dim))
    first, second = _rope_pairs(cfg)
    cos[:, first], cos[:, second] = np.cos(angles), np.cos(angles)
    sin[:, first], sin[:, second] = -np.sin(angles), np.sin(angles)
    dtype = dtype or compute_dtype(xp)
    return xp.asarray(cos[:, None, :], dtype=dtype), xp.asarray(sin[:, None, :], dtype=dtype)


def _rope_pairs(cfg: ModelConfig) -> tuple[slice, slice]:
    """The first and second members of the rotated pairs: adjacent dims (2i, 2i+1) in GGML's normal
    mode, dims (i, i + n/2) in NeoX mode."""
    n = cfg.rope_dims
    if cfg.rope_mode == ROPE_NORMAL:
        return slice(0, n, 2), slice(1, n, 2)
    return slice(0, n // 2), slice(n // 2, n)


def apply_rope(cfg: ModelConfig, x: Array, cos: Array, sin: Array) -> Array:
    """Rotate each pair (a, b) of x [T, heads, head_dim] by its angle: (a cos - b sin, b cos + a sin).

    Written as x * cos + partner(x) * sin with the signed sin of ``rope_table``: a few whole-array
    operations instead of strided writes, which is what costs on the GPU at decode.
    """
    xp = get_array_module(x)
    n = cfg.rope_dims
    if cfg.rope_mode == ROPE_NORMAL:  # swap adjacent dims (those past n are swapped too, times sin 0)
        partner = x.reshape(*x.shape[:-1], -1, 2)[..., ::-1].reshape(x.shape)
    else:                             # swap the two halves of the rotated dims
        partner = xp.concatenate([x[..., n // 2:n], x[..., :n // 2], x[..., n:]], axis=-1)
    return x * cos + partner * sin


def attention(cfg: ModelConfig, q: Array, k: Array, v: Array, pos: int) -> Array:
    """Causal grouped-query attention of T queries at pos.. over keys 0..pos+T.

    q [T, n_head, head_dim]; k, v [S, n_head_kv, head_dim] with S = pos + T. Query head h reads
    KV head h // n_group, as GGML broadcasts it. Returns [T, n_head * head_dim].
    """
    xp = get_array_module(q)
    T, S, G = q.shape[0], k.shape[0], cfg.n_group
    q = q * cfg.query_scale
    qg = q.reshape(T, cfg.n_head_kv, G, cfg.head_dim).transpose(1, 2, 0, 3)    # [n_kv, G, T, hd]
    qg = qg.reshape(cfg.n_head_kv, G * T, cfg.head_dim)                         # [n_kv, G*T, hd]
    scores = qg @ k.transpose(1, 2, 0)                                          # [n_kv, G*T, S]
    scores = scores.astype(np.float32, copy=False).reshape(cfg.n_head_kv, G, T, S)
    if T > 1:
        future = xp.arange(S)[None, :] > (pos + xp.arange(T))[:, None]          # [T, S]
        scores = xp.where(future, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = probs.astype(v.dtype, copy=False).reshape(cfg.n_head_kv, G * T, S)
    out = probs @ v.transpose(1, 0, 2)                                          # [n_kv, G*T, hd]
    out = out.reshape(cfg.n_head_kv, G, T, cfg.head_dim).transpose(2, 0, 1, 3)  # [T, n_kv, G, hd]
    return out.reshape(T, cfg.n_head * cfg.head_dim)


# ---------------------------------------------------------------------------------------------------
# the three steps of a forward pass


def embed(outer: OuterWeights, tokens: Any, xp: Any = np) -> Array:
    """Token ids -> x [T, n_embd] in xp's compute type. Rows are gathered where token_embd lives, so
    a host-side table sends only T rows to the device."""
    table = outer.token_embd
    if isinstance(table, QuantWeight):  # only the rows asked for are decoded
        return xp.asarray(table.take_rows(tokens), dtype=compute_dtype(xp))
    ids = get_array_module(table).asarray(tokens, dtype=np.int64)
    return xp.asarray(table[ids], dtype=compute_dtype(xp))


def layer_forward(cfg: ModelConfig, x: Array, lw: LayerWeights, k_cache: Array, v_cache: Array,
                  pos: int, rope: tuple[Array, Array] | None = None) -> Array:
    """One transformer block on x [T, n_embd] at positions pos..pos+T.

    Writes the T new K/V rows into k_cache/v_cache [n_ctx, n_head_kv, head_dim] at pos and attends
    over rows 0..pos+T. Returns the new x [T, n_embd]. `rope`: the (cos, sin) rows of these positions,
    each [T, 1, head_dim] as ``rope_table`` lays them out; None takes them from ``rope_table``.
    """
    T = x.shape[0]
    xp = get_array_module(x)
    if pos + T > k_cache.shape[0]:
        raise ValueError(f"positions {pos}..{pos + T} do not fit a KV cache of {k_cache.shape[0]}")

    h = rms_norm(x, lw.attn_norm, cfg.rms_eps)                                  # [T, n_embd]
    q = linear(h, lw.wq, lw.bq).reshape(T, cfg.n_head, cfg.head_dim)           # [T, n_head, hd]
    k = linear(h, lw.wk, lw.bk).reshape(T, cfg.n_head_kv, cfg.head_dim)        # [T, n_head_kv, hd]
    v = linear(h, lw.wv, lw.bv).reshape(T, cfg.n_head_kv, cfg.head_dim)        # [T, n_head_kv, hd]
    if rope is None:
        rope = tuple(table[pos:pos + T] for table in rope_table(cfg, k_cache.shape[0], xp))
    cos, sin = rope
    k_cache[pos:pos + T] = apply_rope(cfg, k, cos, sin)
    v_cache[pos:pos + T] = v
    attn = attention(cfg, apply_rope(cfg, q, cos, sin), k_cache[:pos + T], v_cache[:pos + T], pos)
    x = x + linear(attn, lw.wo)                                                 # [T, n_embd]

    h = rms_norm(x, lw.ffn_norm, cfg.rms_eps)
    gated = silu(linear(h, lw.w_gate)) * linear(h, lw.w_up)                     # [T, n_ff] SwiGLU
    return x + linear(gated, lw.w_down)                                         # [T, n_embd]


def output_logits(cfg: ModelConfig, outer: OuterWeights, h: Array) -> Array:
    """Final norm and output projection: h [..., n_embd] -> float32 logits [..., n_vocab]."""
    h = rms_norm(h, outer.output_norm, cfg.rms_eps)
    return linear(h, outer.output).astype(np.float32, copy=False)

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
from functools import cached_property
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from ..kv_types import KVType, cache_kv_type, decode, default_kv_type, encode, kv_type
from ..xp import compute_dtype, get_array_module
from .attention import attention, by_rows, softcap
from .rope import ROPE_NEOX, ROPE_NORMAL, apply_rope, rope_inv_freq, rope_table, yarn_corr_dims  # noqa: F401
from .moe import moe_ffn
from .qweight import QuantWeight

Array = Any  # numpy.ndarray or cupy.ndarray

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
    rope_yarn: tuple[float, float, float, int] | None = None  # YaRN's (ext_factor, beta_fast, beta_slow,
                                        # original context): rope_freq_scale blended back to unscaled
                                        # on the fast-turning pairs
    rope_mscale: float = 1.0            # multiplies cos and sin (YaRN's 1 + 0.1 ln(factor))
    attn_scale: float | None = None     # multiplies q before the dot products; None: 1/sqrt(head_dim)
    pooling: str = "mean"               # how embeddings pool the hidden states: mean, cls, last, none, rank
    activation: str = "silu"            # the FFN's gate: "silu" (SwiGLU), "gelu" (GELU-tanh, the Gemmas) or
                                        # "swiglu_oai" (gpt-oss's clamped SwiGLU: moe.swiglu_oai)
    embd_scale: float = 1.0             # multiplies the token embedding (sqrt(n_embd) for the Gemmas)
    residual_scale: float = 1.0         # multiplies each block's output before it joins the residual (Granite)
    logit_scale: float = 1.0            # multiplies the logits (1 / Granite's logit_scale)
    attn_softcap: float = 0.0           # scores -> c * tanh(scores / c) when above 0 (gemma2)
    final_softcap: float = 0.0          # logits -> c * tanh(logits / c) when above 0 (gemma2)
    sliding_window: int = 0             # positions a sliding layer attends to, itself included; 0: none
    swa_layers: tuple[int, ...] = ()    # the sliding layers
    rope_theta_swa: float | None = None  # the sliding layers' RoPE base; None: rope_theta
    rope_freq_scale_swa: float | None = None  # ... and linear scale; None: rope_freq_scale
    window: int = 0                     # this layer's window (set by ``for_layer``); 0: full attention
    n_expert: int = 0                   # experts of each layer's FFN (pyplugin.model.moe); 0: a dense FFN
    n_expert_used: int = 0              # experts each token runs
    n_ff_exp: int = 0                   # an expert's hidden size
    n_ff_shexp: int = 0                 # the shared expert's hidden size (qwen2moe); 0: none
    expert_norm: bool = False           # the chosen experts' weights renormalised to sum to 1
    expert_scale: float = 1.0           # ... then multiplied by this
    expert_gating: str = "softmax"      # "softmax": over every expert's score; "softmax_chosen" (gpt-oss): the
                                        # best by the router's logits, a softmax over the chosen

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

    def is_sliding(self, i: int) -> bool:
        return self.sliding_window > 0 and i in self.swa_layers

    def kv_rows(self, i: int, n_ctx: int) -> int:
        """Rows of layer i's KV cache for a context of n_ctx: the window on a sliding layer."""
        return min(n_ctx, self.sliding_window) if self.is_sliding(i) else n_ctx

    def for_layer(self, i: int) -> "ModelConfig":
        """The config layer i computes with: its window and, on a sliding layer, its RoPE."""
        return self._layer_configs[i] if 0 <= i < len(self._layer_configs) else self

    @cached_property
    def _layer_configs(self) -> tuple["ModelConfig", ...]:
        own_scale = self.rope_freq_scale_swa is not None  # gemma3's local layers: never scaled, YaRN neither
        sliding = replace(self, window=self.sliding_window,
                          rope_theta=self.rope_theta if self.rope_theta_swa is None else self.rope_theta_swa,
                          rope_freq_scale=self.rope_freq_scale_swa if own_scale else self.rope_freq_scale,
                          rope_freq_factors=self.rope_freq_factors if self.rope_theta_swa is None else None,
                          rope_yarn=None if own_scale else self.rope_yarn,
                          rope_mscale=1.0 if own_scale else self.rope_mscale)
        return tuple(sliding if self.is_sliding(i) else self for i in range(self.n_layer))


@dataclass
class LayerWeights:
    """One layer's arrays, the same fields for every architecture."""

    attn_norm: Array            # [n_embd]
    wq: Array                   # [n_head * head_dim, n_embd]
    wk: Array                   # [n_head_kv * head_dim, n_embd]
    wv: Array                   # [n_head_kv * head_dim, n_embd]
    wo: Array                   # [n_embd, n_head * head_dim]
    ffn_norm: Array             # [n_embd]
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

    k: list[Array]              # per layer [rows, n_head_kv, width]: n_ctx rows, a sliding layer its window
    v: list[Array]              # per layer [rows, n_head_kv, width] (width: head_dim, or a block type's bytes)

    @classmethod
    def allocate(cls, cfg: ModelConfig, n_ctx: int, xp: Any = np, kv: KVType | str | None = None) -> "KVCache":
        """Caches of KV type `kv` (a name or a KVType; default the server's, kv_types.default_kv_type)."""
        kv = kv if isinstance(kv, KVType) else kv_type(kv or default_kv_type(cfg.head_dim))
        kv.check_head_dim(cfg.head_dim)
        shapes = [kv.shape(cfg.kv_rows(i, n_ctx), cfg.n_head_kv, cfg.head_dim) for i in range(cfg.n_layer)]
        return cls([xp.zeros(shape, kv.dtype) for shape in shapes], [xp.zeros(shape, kv.dtype) for shape in shapes])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


# ---------------------------------------------------------------------------------------------------
# building blocks


def linear(x: Array, w: Array | QuantWeight, b: Array | None = None) -> Array:
    """x @ w.T (+ b); w a dense array, or a matrix in its GGUF form (computed by its kernels)."""
    y = w.matmul(x) if isinstance(w, QuantWeight) else x @ w.T
    return y if b is None else y + b


@by_rows(0)
def rms_norm(x: Array, w: Array, eps: float) -> Array:
    # In float32 whatever the compute type: a float16 sum of squares overflows on real activations.
    xf = x.astype(np.float32, copy=False)
    xp = get_array_module(x)
    scale = 1.0 / xp.sqrt((xf * xf).mean(axis=-1, keepdims=True) + eps)
    return (xf * scale * w).astype(x.dtype, copy=False)


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
    table = outer.token_embd
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
                  experts: Any = None) -> Array:
    """One transformer block: ``attention_block`` then ``ffn_block`` (`experts`: moe.moe_ffn's)."""
    return ffn_block(cfg, attention_block(cfg, x, lw, k_cache, v_cache, pos, rope, attend), lw, experts)


def attention_block(cfg: ModelConfig, x: Array, lw: LayerWeights, k_cache: Array, v_cache: Array,
                    pos: int, rope: tuple[Array, Array] | None = None, attend: Attend | None = None) -> Array:
    """The attention half of a transformer block on x [T, n_embd] at positions pos..pos+T; `cfg` is the layer's own
    (ModelConfig.for_layer).

    Writes the T new K/V rows into k_cache/v_cache [rows, n_head_kv, head_dim] and attends over the
    positions the layer sees. A cache of fewer rows than pos+T is a ring (a sliding layer's window):
    position p is row p % rows, and the keys still needed are read before the new ones are written.
    Returns the new x [T, n_embd]. `rope`: the (cos, sin) rows of these positions, each [T, 1, head_dim]
    as ``rope_table`` lays them out; None takes them from ``rope_table``. `attend`: the kernels' attention in
    place of ``attention``: `tokens` for one token on a layer without a window (its row written by that
    call), `chunk` for a prompt chunk (T > 1) on any layer whose cache is not a ring.
    """
    T = x.shape[0]
    xp = get_array_module(x)
    rows = k_cache.shape[0]
    ring = cfg.window and rows < pos + T
    if pos + T > rows and not (ring and rows >= cfg.window):
        raise ValueError(f"positions {pos}..{pos + T} do not fit a KV cache of {rows}")

    h = rms_norm(x, lw.attn_norm, cfg.rms_eps)                                  # [T, n_embd]
    q = linear(h, lw.wq, lw.bq).reshape(T, cfg.n_head, cfg.head_dim)           # [T, n_head, hd]
    k = linear(h, lw.wk, lw.bk).reshape(T, cfg.n_head_kv, cfg.head_dim)        # [T, n_head_kv, hd]
    v = linear(h, lw.wv, lw.bv).reshape(T, cfg.n_head_kv, cfg.head_dim)        # [T, n_head_kv, hd]
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, cfg.rms_eps)
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, cfg.rms_eps)
    if rope is None:  # a table of a power of two positions, so that few are made
        rope = tuple(table[pos:pos + T] for table in rope_table(cfg, 1 << (pos + T - 1).bit_length(), xp))
    cos, sin = rope
    k = apply_rope(cfg, k, cos, sin)
    # The caches hold their KV type (f16, or q8_0/q4_0 blocks); attention reads them back as x's dtype,
    # so it sees exactly what a later step will read.
    kv, dt = cache_kv_type(k_cache, cfg.head_dim), x.dtype
    if ring:
        lo = max(0, pos - cfg.window + 1)                  # the oldest position a query here sees
        old = xp.arange(lo, pos) % rows
        k_rows, v_rows = encode(k, kv), encode(v, kv)
        keys = xp.concatenate([decode(k_cache[old], kv, dt), decode(k_rows, kv, dt)])
        values = xp.concatenate([decode(v_cache[old], kv, dt), decode(v_rows, kv, dt)])
        keep = min(T, rows)                                # the newest rows only: they fill the ring
        at = xp.arange(pos + T - keep, pos + T) % rows
        k_cache[at], v_cache[at] = k_rows[T - keep:], v_rows[T - keep:]
        attn = attention(cfg, apply_rope(cfg, q, cos, sin), keys, values, pos, lo, lw.attn_sinks)
    else:
        if attend is not None and T == 1 and not cfg.window and lw.attn_sinks is None:  # the row written (encoded)
            # by the kernels' call (which has no sinks)
            attn = attend.tokens(cfg, apply_rope(cfg, q, cos, sin), [(k_cache, v_cache)], [pos + 1], (k, v))
        else:
            k_cache[pos:pos + T], v_cache[pos:pos + T] = encode(k, kv), encode(v, kv)
            if attend is not None and T > 1:  # a prompt chunk: the kernels' attention over the rows written
                attn = attend.chunk(cfg, apply_rope(cfg, q, cos, sin), (k_cache, v_cache), pos + T, lw.attn_sinks)
            else:
                attn = attention(cfg, apply_rope(cfg, q, cos, sin), decode(k_cache[:pos + T], kv, dt),
                                 decode(v_cache[:pos + T], kv, dt), pos, 0, lw.attn_sinks)
    out = linear(attn, lw.wo, lw.bo)                                                 # [T, n_embd]
    if lw.post_attn_norm is not None:
        out = rms_norm(out, lw.post_attn_norm, cfg.rms_eps)
    return x + (out if cfg.residual_scale == 1.0 else out * cfg.residual_scale)


def ffn_block(cfg: ModelConfig, x: Array, lw: LayerWeights, experts: Any = None, max_rows: int = 0) -> Array:
    """The feed-forward half of a transformer block on x [T, n_embd], each row on its own; `experts` and
    `max_rows`: where the experts come from and how many rows go through a matrix at once (moe.moe_ffn)."""
    h = rms_norm(x, lw.ffn_norm, cfg.rms_eps)
    if lw.ffn_gate_inp is not None:                                             # experts
        out = moe_ffn(cfg, h, lw, experts, max_rows).astype(x.dtype, copy=False)  # [T, n_embd]
    else:
        act = gelu_tanh if cfg.activation == "gelu" else silu
        gated = act(linear(h, lw.w_gate))                                       # [T, n_ff]
        gated *= linear(h, lw.w_up)
        out = linear(gated, lw.w_down)                                          # [T, n_embd] gated FFN
    if lw.post_ffn_norm is not None:
        out = rms_norm(out, lw.post_ffn_norm, cfg.rms_eps)
    return x + (out if cfg.residual_scale == 1.0 else out * cfg.residual_scale)


def output_logits(cfg: ModelConfig, outer: OuterWeights, h: Array) -> Array:
    """Final norm and output projection: h [..., n_embd] -> float32 logits [..., n_vocab]."""
    h = rms_norm(h, outer.output_norm, cfg.rms_eps)
    logits = linear(h, outer.output).astype(np.float32, copy=False)
    if cfg.logit_scale != 1.0:
        logits = logits * np.float32(cfg.logit_scale)
    return softcap(logits, cfg.final_softcap)

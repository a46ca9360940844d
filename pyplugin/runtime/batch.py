"""A decode step over a batch: one token of each of B sequences, each at its own position with its own
KV cache, in one pass over the layers; and the prefills of sequences that join a batch together, in
one pass too.

The weight products take all B rows at once where that gives each row exactly what it gets alone:
the fused dequantize-and-multiply kernel (a QuantWeight, the default form) sums each vector in the
same order whatever the number of vectors beside it. A dense matrix (the `f16` form) is multiplied one
row at a time, because a BLAS GEMM over B rows rounds differently from its one-row product; batching
still pays a streamed layer's transfer once. Attention runs per sequence over its own cache length.
So every sequence's tokens are those it produces alone (tests/test_batching.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..kv_types import cache_kv_type, decode, encode
from ..model import QuantWeight, embed, output_logits
from ..model.qweight import needs_expansion
from ..model.gemma4 import per_layer_inputs
from ..model.transformer import Attend, ModelConfig, LayerWeights, apply_rope, attention, rms_norm, rope_table, silu
from ..xp import get_array_module, to_numpy
from .generation import Generation, attend_through
from .store_layers import StoreLayers

Array = Any


def linear_rows(x: Array, w: Array | QuantWeight, b: Array | None = None) -> Array:
    """x @ w.T (+ b) for x [n, cols], each row exactly as `transformer.linear` computes it alone: stored
    blocks in one call where the kernels multiply every row alike whatever the number beside it (up to
    their vector limit, or any number on kernels with tiled_matmul), dense matrices a row at a time."""
    if isinstance(w, QuantWeight):
        kernels, n = w.kernels, x.shape[0]
        whole = n <= kernels.max_vec or (getattr(kernels, "tiled_matmul", False) and w.dense_view() is None)
        step = n if whole else kernels.max_vec
        parts = [w.matmul(x[i:i + step]) for i in range(0, n, step)]
    else:
        parts = [x[i:i + 1] @ w.T for i in range(x.shape[0])]
    y = parts[0] if len(parts) == 1 else get_array_module(x).concatenate(parts)
    return y if b is None else y + b


def batched_layer(cfg: ModelConfig, x: Array, lw: LayerWeights, caches: Sequence[tuple[Array, Array]],
                  positions: Sequence[int], attend: Attend | None = None,
                  lengths: Sequence[int] | None = None) -> Array:
    """One transformer block on x [n, n_embd] holding lengths[b] rows (default 1) of the sequence at
    positions[b].. whose caches are caches[b]: `transformer.layer_forward` for each sequence's rows, with
    every row-wise step over all rows at once (a decode step's tokens, or the prompts of a batched prefill)
    and the attention per sequence, or one `attend.tokens` call (the kernels' attention) where each has one
    row."""
    lengths = list(lengths) if lengths is not None else [1] * len(positions)
    n, xp, n_ctx = x.shape[0], get_array_module(x), caches[0][0].shape[0]
    for pos, T in zip(positions, lengths):
        if pos + T > n_ctx:
            raise ValueError(f"positions {pos}..{pos + T} do not fit a KV cache of {n_ctx}")
    h = rms_norm(x, lw.attn_norm, cfg.rms_eps)                                     # [n, n_embd]
    q = linear_rows(h, lw.wq, lw.bq).reshape(n, cfg.n_head, cfg.head_dim)          # [n, n_head, hd]
    k = linear_rows(h, lw.wk, lw.bk).reshape(n, cfg.n_head_kv, cfg.head_dim)       # [n, n_head_kv, hd]
    v = linear_rows(h, lw.wv, lw.bv).reshape(n, cfg.n_head_kv, cfg.head_dim)
    # Each row rotated by its own position's angles: elementwise, so row r is what it is alone.
    if n == len(positions):  # a token each (a decode step): row b is sequence b's
        rows, starts = positions, range(n)
    else:
        rows = np.concatenate([np.arange(pos, pos + T) for pos, T in zip(positions, lengths)])
        starts = np.cumsum([0] + lengths[:-1]).tolist()
    cos, sin = (table[xp.asarray(rows)] for table in rope_table(cfg, n_ctx, xp))  # [n, 1, hd]
    q, k = apply_rope(cfg, q, cos, sin), apply_rope(cfg, k, cos, sin)
    if attend is not None and n == len(positions):  # a token each: stored and attended in one call
        attn = attend.tokens(cfg, q, list(caches), [pos + 1 for pos in positions], (k, v))  # [n, n_head * hd]
    else:
        kv, dt = cache_kv_type(caches[0][0], cfg.head_dim), x.dtype  # the caches' type, read back as x's
        for (k_cache, v_cache), pos, T, s in zip(caches, positions, lengths, starts):
            k_cache[pos:pos + T] = encode(k[s:s + T], kv)
            v_cache[pos:pos + T] = encode(v[s:s + T], kv)
        parts = []
        for (k_cache, v_cache), pos, T, s in zip(caches, positions, lengths, starts):
            if attend is None:
                parts.append(attention(cfg, q[s:s + T], decode(k_cache[:pos + T], kv, dt),
                                       decode(v_cache[:pos + T], kv, dt), pos))
            elif T == 1:  # one token, its row written
                parts.append(attend.tokens(cfg, q[s:s + 1], [(k_cache, v_cache)], [pos + 1], None))
            else:
                parts.append(attend.chunk(cfg, q[s:s + T], (k_cache, v_cache), pos + T))
        attn = xp.concatenate(parts)
    x = x + linear_rows(attn, lw.wo)                                               # [n, n_embd]
    h = rms_norm(x, lw.ffn_norm, cfg.rms_eps)
    gated = silu(linear_rows(h, lw.w_gate))                                        # [n, n_ff] SwiGLU
    gated *= linear_rows(h, lw.w_up)
    return x + linear_rows(gated, lw.w_down)


EXTRA_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")  # what batched_layer does not compute


def block_alike(cfg: ModelConfig) -> bool:
    """Whether batched_layer computes a layer of this config (ModelConfig.for_layer) as layer_forward does,
    where its weights have none of EXTRA_NORMS: the Llama, Qwen 2 and Phi-3 block (not GELU, a window's
    ring, capped scores, Granite's scales or experts)."""
    return cfg.activation == "silu" and not cfg.window and not cfg.attn_softcap and cfg.residual_scale == 1.0 and \
        not cfg.n_expert


def batched_logits(cfg: ModelConfig, outer, x: Array) -> list[np.ndarray]:
    """Final norm and output projection of each row of x [B, n_embd], as `output_logits` of that row."""
    xp = get_array_module(x)
    if cfg.logit_scale != 1.0 or cfg.final_softcap:  # scaled or capped logits: each row as alone
        return [to_numpy(output_logits(cfg, outer, row)) for row in x]
    h = rms_norm(x, outer.output_norm, cfg.rms_eps)
    if isinstance(outer.output, QuantWeight):
        return list(to_numpy(linear_rows(h, outer.output).astype(np.float32, copy=False)))  # one copy off the device
    # Alone the last hidden state is a vector: a dense product of a vector, row by row here too.
    return [to_numpy((xp.ascontiguousarray(row) @ outer.output.T).astype(np.float32, copy=False)) for row in h]


def decode_batch(source: StoreLayers, generations: Sequence[Generation], tokens: Sequence[int]) -> list[np.ndarray]:
    """Runs token b through the layers for generations[b] (each a sequence of `source`, at its own
    position) in one call of the plan's decoder; float32 logits of each, in order. Advances each
    generation's position."""
    first, xp, outer = generations[0], source.xp, source.outer
    x = xp.ascontiguousarray(embed(outer, list(tokens), xp, first.cfg.embd_scale, np.float32))  # [B, n_embd]
    logits = source.decode_step([g.layers.seq for g in generations], [g.pos for g in generations], x,
                                per_layer_inputs(first.cfg, outer, list(tokens), x))  # Gemma 4's, else None
    for g in generations:
        g.pos += 1
    return list(to_numpy(logits))


def prefills_together(source: StoreLayers, generations: Sequence[Generation]) -> bool:
    """Whether prefill_batch computes these generations' prompts as each one's own prefill does: every
    layer one batched_layer computes alike, and every matrix in stored blocks on kernels that multiply
    any number of rows alike (tiled_matmul: the host's), as a prefill alone multiplies its chunk."""
    pebbled = source.pebbled
    if len(generations) < 2 or not getattr(pebbled.kernels, "tiled_matmul", False):
        return False
    for lcfg, layout in zip(generations[0].layer_cfgs, pebbled.layouts):  # the weights are not in view yet
        tensors = {t.name: t for t in layout}
        if not block_alike(lcfg) or tensors.keys() & set(EXTRA_NORMS):
            return False
        if not all(tensors[m].qtype is not None and needs_expansion(tensors[m].qtype, source.dtype)
                   for m in MATRICES):
            return False
    output = source.outer.output
    return isinstance(output, QuantWeight) and output.dense_view() is None


MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def prefill_batch(source: StoreLayers, generations: Sequence[Generation], chunks: Sequence[Sequence[int]]
                  ) -> list[np.ndarray]:
    """Runs chunks[b] (at most num_batch tokens) through the layers for generations[b], each at its own
    position, in one pass (prefills_together must hold); float32 logits of each chunk's last token, in
    order. Advances each generation's position."""
    first, xp, outer = generations[0], source.xp, source.outer
    cfg = first.cfg
    seqs = [g.layers.seq for g in generations]
    positions, lengths = [g.pos for g in generations], [len(c) for c in chunks]
    source.begin_pass([(seq, pos, n) for seq, pos, n in zip(seqs, positions, lengths)])
    attend = attend_through(source.attend_kernels)
    x = embed(outer, [t for c in chunks for t in c], xp, cfg.embd_scale)         # [sum(lengths), n_embd]
    for i, lcfg in enumerate(first.layer_cfgs):
        x = batched_layer(lcfg, x, source.weights(i), source.pass_caches(i), positions, attend,
                          lengths)
        source.done(i)
    for g, n in zip(generations, lengths):
        g.pos += n
    last = np.cumsum(lengths) - 1
    return batched_logits(cfg, outer, x[xp.asarray(last)])

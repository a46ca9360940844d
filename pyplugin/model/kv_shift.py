"""Context shift: when a generation is about to fill num_ctx, keep its first num_keep positions, drop half of
the rest and move what follows down, as llama.cpp's server does it (and so Ollama, which runs that server).
A kept key was rotated (RoPE) for its old position; rotating it by minus the shift puts it where it now is
(R(p - d) = R(-d) R(p)), so nothing is recomputed. Keys of a block type are decoded, rotated and encoded
again, as llama.cpp re-quantizes them.

A sliding layer's ring (row p % W for the last W positions) is rolled so that each position lands on its
new row; its window after the shift must lie past the kept positions, which it no longer holds
(`shiftable`).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..kv_types import cache_kv_type, decode, encode
from ..xp import get_array_module
from .rope import _rope_pairs, apply_rope, rope_inv_freq
from .transformer import ModelConfig

Array = Any


def shift_due(n_past: int, n_ctx: int) -> bool:
    """Whether a context of n_ctx holding n_past positions shifts before its next token goes in: as llama.cpp's
    server (which Ollama runs) decides it, once that token would fill the last position (n_past + 1 >= n_ctx)."""
    return n_past + 1 >= n_ctx


def shift_amount(n_past: int, n_keep: int, n_ctx: int) -> tuple[int, int]:
    """(positions kept at the start, positions dropped after them) when a context of n_ctx holding n_past
    positions shifts, as llama.cpp's server counts them: n_keep (at most n_ctx - 4, and all but one
    position), then half of the rest dropped. Its caller counts the BOS a model adds into n_keep, as
    llama.cpp's server does (Ollama passes its num_keep there)."""
    keep = max(0, min(n_keep, n_ctx - 4, n_past - 1))
    return keep, (n_past - keep) // 2


def plan_shift(n_past: int, n_keep: int, n_ctx: int, rows: Iterable[int]) -> tuple[int, int] | None:
    """`shift_amount` where every cache (of `rows` each, a ring's window or n_ctx) can shift that much and
    something is dropped, else None."""
    keep, drop = shift_amount(n_past, n_keep, n_ctx)
    if drop < 1 or not all(shiftable(r, n_past, keep, drop) for r in rows):
        return None
    return keep, drop


def shiftable(rows: int, n_past: int, n_keep: int, n_discard: int) -> bool:
    """Whether a cache of `rows` can shift: a full cache always; a ring only where its window after the
    shift lies past the kept positions (it no longer holds those that are out of its window)."""
    return rows >= n_past or n_past - n_discard - rows >= n_keep


def shift_caches(cfg: ModelConfig, k: Array, v: Array, n_keep: int, n_discard: int, n_past: int) -> None:
    """Layer `cfg`'s K and V caches [rows, n_head_kv, width] of a context of n_past positions, shifted in
    place: positions n_keep + n_discard.. move to n_keep.., their keys rotated by -n_discard."""
    rows = k.shape[0]
    if not shiftable(rows, n_past, n_keep, n_discard):
        raise ValueError(f"a ring of {rows} rows cannot shift {n_discard} of {n_past} positions keeping {n_keep}")
    if n_discard < 1:
        return
    xp = get_array_module(k)
    if rows >= n_past:  # rows in position order
        moved = slice(n_keep + n_discard, n_past)
        to = slice(n_keep, n_past - n_discard)
        k[to] = rotate(cfg, k[moved], -n_discard)
        v[to] = v[moved].copy()
        return
    # a ring: row r holds the position p = r (mod rows) of the last `rows` ones, every one of them moved
    order = (xp.arange(rows) + n_discard) % rows  # new row r <- old row (r + n_discard) % rows
    k[...] = rotate(cfg, k[order], -n_discard)
    v[...] = v[order]


def rotate(cfg: ModelConfig, rows: Array, delta: int) -> Array:
    """Cache rows (any KV type) with their keys rotated by `delta` positions, in the same type."""
    xp, kv = get_array_module(rows), cache_kv_type(rows, cfg.head_dim)
    angles = delta * rope_inv_freq(cfg)                                      # [rope_dims / 2], float64
    cos, sin = np.ones(cfg.head_dim), np.zeros(cfg.head_dim)
    first, second = _rope_pairs(cfg)
    cos[first], cos[second] = np.cos(angles), np.cos(angles)
    sin[first], sin[second] = -np.sin(angles), np.sin(angles)               # signed as rope_table's
    keys = decode(rows, kv, np.float32)
    cos, sin = (xp.asarray(t, dtype=np.float32) for t in (cos, sin))
    return encode(apply_rope(cfg, keys, cos, sin), kv)

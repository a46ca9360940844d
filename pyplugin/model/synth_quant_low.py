"""Quantizers for the low-bit GGUF types gguf-py reads but cannot write: Q2_K, Q3_K, IQ4_NL and IQ4_XS.

Simple fits, not llama-quantize's searches: what a synthetic model needs is blocks that decode to about
the values given (tests hold each to gguf-py's dequantizer within a bound the format sets), written
quickly. Where a block's values already lie on the format's grid they come back exactly, which is what
a test of a block's layout can check to the bit.
"""

from __future__ import annotations

import numpy as np

# IQ4_NL's and IQ4_XS's 16 non-linear levels (gguf.quants.IQ4_NL.kvalues), ascending: a nibble indexes them.
KVALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32)
Q3_LEVELS = np.arange(-4, 4, dtype=np.float32)  # Q3_K's q, stored as q + 4 (two low bits and a high one)

# The levels a group's largest value is tried at, outermost first (on a tie the smaller scale wins). Each
# set holds the level that spans the whole group without clipping (113 of the kvalues, 3 of Q3_K's),
# which bounds the fit's error; and the outer levels a grid's largest value can sit at, so that values
# already on a grid find its scale again.
_KV_TRIED = (-127.0, 113.0, -104.0, 89.0)
_Q3_TRIED = (-4.0, 3.0, -3.0)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[n] float -> [n, 2] the fp16's little-endian bytes."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _nearest(grid: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Index of the grid value (ascending) nearest each v."""
    return np.searchsorted((grid[1:] + grid[:-1]) / 2, v).astype(np.uint8)


def _best_scale(x: np.ndarray, grid: np.ndarray, tried: tuple[float, ...], to_f16: bool) -> np.ndarray:
    """x [n, g] -> [n] the scale s, one per group, for which s * grid[nearest] is closest to x (least
    squares) among those putting the group's largest-magnitude value on one of the `tried` levels; fp16
    values already when `to_f16` (the scale is stored as it is)."""
    x_e = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)[:, 0]        # [n]
    best_s, best_err = None, None
    for level in tried:
        s = x_e / np.float32(level)
        if to_f16:
            s = s.astype(np.float16).astype(np.float32)
        err = np.square(x - s[:, None] * grid[_nearest(grid, _safe_div(x, s[:, None]))]).sum(-1)
        if best_s is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s, best_err = np.where(better, s, best_s), np.where(better, err, best_err)
    return best_s + np.float32(0)  # -0.0 (a group of zeros over a negative level) as +0: zero bytes


def _super_scale(s: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales s [n, k] as d * sc with one fp16 d per block and sc in -top..top: (d [n] as
    float16, sc [n, k] int8)."""
    d = (np.abs(s).max(-1) / np.float32(top)).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(s, d.astype(np.float32)[:, None])), -top, top).astype(np.int8)
    return d, sc


def _two_bits(q: np.ndarray) -> np.ndarray:
    """[n, 256] values 0..3 -> [n, 64] bytes: in each half of the block, element 32j + l in byte l's bits
    2j, 2j+1 (Q2_K's and Q3_K's qs)."""
    q = q.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return np.bitwise_or.reduce(q, axis=2).reshape(-1, 64)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 -> [..., 16] bytes: element l in byte l's low nibble, 16 + l in its high one."""
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K blocks of 256 values (84 bytes): 16 sub-blocks of 16, each value = d*sc*q - dmin*m with 2-bit
    q and 4-bit sc, m (a byte per sub-block: sc low, m high), then qs, then fp16 d and dmin. A min/max fit
    per sub-block, as _k_fit's."""
    rows, cols = x.shape
    sub = x.reshape(-1, 16, 16).astype(np.float32)                               # [n, 16, 16]
    lo, hi = np.minimum(sub.min(-1), 0.0), sub.max(-1)                           # [n, 16]
    step, offset = (hi - lo) / np.float32(3), -lo
    d = (step.max(-1) / np.float32(15)).astype(np.float16)                       # [n]
    dmin = (offset.max(-1) / np.float32(15)).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32)[:, None])), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(offset, dmin.astype(np.float32)[:, None])), 0, 15).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc                                   # what gets stored
    shift = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_safe_div(sub + shift[..., None], scale[..., None])), 0, 3).astype(np.uint8)
    blocks = np.concatenate([sc | (m << 4), _two_bits(q.reshape(-1, 256)), _f16_bytes(d), _f16_bytes(dmin)], axis=1)
    return blocks.reshape(rows, cols // 256 * 84)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K blocks of 256 values (110 bytes): 16 sub-blocks of 16, each value = d*sc*q with q in -4..3 and
    6-bit signed sc (here -31..31): hmask (q's high bits), qs (its two low bits), the 12 bytes of scales,
    fp16 d. Symmetric: each sub-block's scale the best of a few (_Q3_TRIED), then d = max|scale| / 31."""
    rows, cols = x.shape
    sub = x.reshape(-1, 16).astype(np.float32)                                   # [n*16, 16]
    s = _best_scale(sub, Q3_LEVELS, _Q3_TRIED, to_f16=False).reshape(-1, 16)     # [n, 16]
    d, sc = _super_scale(s, 31)
    scale = (d.astype(np.float32)[:, None] * sc).reshape(-1, 1)
    q = _nearest(Q3_LEVELS, _safe_div(sub, scale)).reshape(-1, 256)              # q + 4, 0..7
    hmask = np.bitwise_or.reduce((q >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    u = (sc.astype(np.int16) + 32).astype(np.uint8)                              # [n, 16] 6-bit
    low, high = u & 0x0F, (u >> 4).reshape(-1, 4, 4)                            # high[:, s, b]: scale 4s + b
    packed = np.concatenate([low[:, :8] | (low[:, 8:] << 4),
                             np.bitwise_or.reduce(high << (2 * np.arange(4, dtype=np.uint8))[None, :, None], axis=1)],
                            axis=1)
    blocks = np.concatenate([hmask, _two_bits(q & 3), packed, _f16_bytes(d)], axis=1)
    return blocks.reshape(rows, cols // 256 * 110)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of 32 values (18 bytes): fp16 d, then 4-bit indices into KVALUES; value = d*kvalue.
    d the best of a few (_KV_TRIED), each value the nearest level."""
    rows, cols = x.shape
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = _best_scale(blocks, KVALUES, _KV_TRIED, to_f16=True)
    q = _nearest(KVALUES, _safe_div(blocks, d[:, None]))
    return np.concatenate([_f16_bytes(d), _nibbles(q)], axis=1).reshape(rows, cols // 32 * 18)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks of 256 values (136 bytes): 8 sub-blocks of 32, value = d*sc*kvalue with 6-bit signed
    sc (here -31..31): fp16 d, sc's high 2 bits (a little-endian uint16, sub-block j at bit 2j), their low
    4 bits (two a byte), then IQ4_NL's nibbles per sub-block. Each sub-block's scale the best of a few,
    then d = max|scale| / 31 and each value the nearest level at the scale stored."""
    rows, cols = x.shape
    sub = x.reshape(-1, 32).astype(np.float32)                                   # [n*8, 32]
    s = _best_scale(sub, KVALUES, _KV_TRIED, to_f16=False).reshape(-1, 8)        # [n, 8]
    d, sc = _super_scale(s, 31)
    scale = (d.astype(np.float32)[:, None] * sc).reshape(-1, 1)
    q = _nearest(KVALUES, _safe_div(sub, scale)).reshape(-1, 8, 32)
    u = (sc.astype(np.int16) + 32).astype(np.uint16)                             # [n, 8] 6-bit
    scales_h = np.bitwise_or.reduce((u >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    scales_l = (u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)
    blocks = np.concatenate([_f16_bytes(d), scales_h.astype("<u2").view(np.uint8).reshape(-1, 2),
                             scales_l.astype(np.uint8), _nibbles(q).reshape(-1, 128)], axis=1)
    return blocks.reshape(rows, cols // 256 * 136)

"""Writing weights in GGUF's block formats, for synthetic models: gguf-py's quantizers where it has
them (the legacy types, MXFP4), and plain fits of ours for the K-quants and IQ4s (which gguf-py can read
but not write; the low-bit ones in synth_quant_low); or random valid blocks written directly
(random_blocks), for shapes too large to quantize from floats quickly."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from .synth_quant_low import quantize_iq4_nl, quantize_iq4_xs, quantize_q2_k, quantize_q3_k

T = GGMLQuantizationType


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """x [rows, cols] as GGUFWriter takes it: float32/float16 arrays, or the uint8 blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    if x.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {block} values; "
                         f"this tensor's rows have {x.shape[-1]}")
    if qtype == T.F32:
        return x.astype(np.float32)
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype in _OURS:
        return _OURS[qtype](x.astype(np.float32, copy=False))
    return gguf_quants.quantize(x, qtype)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _k_fit(x: np.ndarray, top: int):
    """The min/max fit Q4_K and Q5_K share: 256-value blocks of 8 sub-blocks of 32, each value =
    d*sc*q - dmin*m with q in 0..top and 6-bit sc, m. Returns (d and dmin as fp16 bytes, the 12 packed
    scale bytes, q [n, 8, 32])."""
    sub = x.reshape(-1, 8, 32).astype(np.float32)                                # [n, 8, 32]
    lo, hi = np.minimum(sub.min(-1), 0.0), sub.max(-1)                           # [n, 8]
    step, offset = (hi - lo) / float(top), -lo
    d = _f16(step.max(-1) / 63.0)                                                # [n]
    dmin = _f16(offset.max(-1) / 63.0)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(offset, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc                                   # what gets stored
    shift = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_safe_div(sub + shift[..., None], scale[..., None])), 0, top).astype(np.uint8)
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),                    # 6-bit sc 0..3, high bits of sc 4..7
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
    ], axis=1)
    scales = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed], axis=1)
    return scales, q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] values -> [n, 128] bytes: sub-block 2j in the low nibbles, 2j+1 in the high ones."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of 256 values with 4-bit q. A plain min/max fit (gguf-py can read Q4_K but not
    write it)."""
    rows, cols = x.shape
    scales, q = _k_fit(x, 15)
    return np.concatenate([scales, _low_nibbles(q)], axis=1).reshape(rows, cols // 256 * 144)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Q5_K blocks of 256 values with 5-bit q: Q4_K's layout plus 32 bytes holding each value's fifth
    bit (sub-block j's in bit j)."""
    rows, cols = x.shape
    scales, q = _k_fit(x, 31)
    high = (q >> 4).astype(np.uint8)                                             # [n, 8, 32]
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)   # [n, 32]
    return np.concatenate([scales, qh, _low_nibbles(q)], axis=1).reshape(rows, cols // 256 * 176)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of 256 values: 16 sub-blocks of 16, each value = d*sc*(q-32) with 6-bit q and
    8-bit sc, q split into 4 low bits (ql) and 2 high bits (qh)."""
    rows, cols = x.shape
    sub = x.reshape(-1, 16, 16).astype(np.float32)                               # [n, 16, 16]
    step = np.abs(sub).max(-1) / 31.0                                            # [n, 16]
    d = _f16(step.max(-1) / 127.0)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(_safe_div(sub, scale[..., None])), -32, 31) + 32).astype(np.uint8)
    halves = q.reshape(-1, 2, 128)                       # each half of the block packs on its own
    low = halves & 0x0F
    ql = low[:, :, :64] | (low[:, :, 64:] << 4)                                  # [n, 2, 64]
    high = (halves >> 4).reshape(-1, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, cols // 256 * 210)


_OURS = {T.Q2_K: quantize_q2_k, T.Q3_K: quantize_q3_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k,
         T.Q6_K: quantize_q6_k, T.IQ4_NL: quantize_iq4_nl, T.IQ4_XS: quantize_iq4_xs}


# random_blocks: where each block type keeps its fp16 scale fields (byte offsets), what the spread of its
# quants is (so that d = std / spread gives values of about `std`), and for the types with a minimum, the
# minimum's multiple of d that centres the values on 0 (K-quants: over all sub-blocks, not each one).
# The spreads of the new types are the RMS of their uniform random quants times sub-block scales: Q2_K's
# sc*q - 1.5*m (4-bit sc, m; 2-bit q), Q3_K's (u-32)*q (6-bit u, q in -4..3), the IQ4s' kvalues (times
# u-32 for IQ4_XS), MXFP4's doubled e2m1 values, whose scale is its E8M0 byte 0 rather than an fp16 field.
_SCALES = {T.Q8_0: ((0,), 74.0, None), T.Q4_0: ((0,), 4.6, None), T.Q5_0: ((0,), 9.2, None),
           T.Q4_1: ((0, 2), 4.6, -7.5), T.Q5_1: ((0, 2), 9.2, -15.5), T.Q2_K: ((80, 82), 13.9, 1.5),
           T.Q3_K: ((108,), 43.3, None), T.Q4_K: ((0, 2), 250.0, 7.5), T.Q5_K: ((0, 2), 500.0, 15.5),
           T.Q6_K: ((208,), 175.0, None), T.IQ4_NL: ((0,), 67.4, None), T.IQ4_XS: ((0,), 1246.0, None),
           T.MXFP4: ((), 5.85, None)}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
                  std: float) -> np.ndarray:
    """[rows, cols] weights of about `std` as `qtype`'s blocks, made directly: random quants and sub-block
    scales, fp16 scales set so the values spread as `std` (Q6_K's 8-bit sub-block scales held to -16..16;
    MXFP4's power-of-two scale: within a factor of sqrt(2) of it), never quantized from floats, so that a
    file of billions of weights is written in seconds. F32 and F16: normal values."""
    if qtype in (T.F32, T.F16):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)).astype(
            np.float32 if qtype == T.F32 else np.float16)
    if qtype not in _SCALES:
        raise ValueError(f"random blocks of {qtype.name} are not written; types: "
                         f"{', '.join(t.name for t in (T.F32, T.F16, *_SCALES))}")
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {block} values; these have {cols}")
    n = rows * (cols // block)
    out = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    offsets, spread, minimum = _SCALES[qtype]
    if qtype == T.MXFP4:  # E8M0: the scale is 2**(e - 128) (gguf's e8m0_to_fp32_half), e held to 1..254
        out[:, 0] = int(np.clip(np.rint(np.log2(std / spread)) + 128, 1, 254)) if std > 0 else 0
        return out.reshape(rows, cols // block * size)
    d = np.float16(std / spread)
    out[:, offsets[0]:offsets[0] + 2] = np.frombuffer(d.tobytes(), np.uint8)
    if minimum is not None:  # Q4_1/Q5_1's m (added), the K-quants' dmin (subtracted)
        out[:, offsets[1]:offsets[1] + 2] = np.frombuffer(np.float16(float(d) * minimum).tobytes(), np.uint8)
    if qtype == T.Q6_K:
        out[:, 192:208] = rng.integers(-16, 17, (n, 16), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, cols // block * size)

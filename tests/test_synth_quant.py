"""synth's quantizers for the types gguf-py reads but cannot write (Q2_K, Q3_K, IQ4_NL, IQ4_XS; and MXFP4,
which goes through gguf-py's own), held to gguf-py's dequantizer: the reference that defines each layout.

Two kinds of check. Random values over five decades decode within a bound the format and the fit set, per
block; a wrong field, nibble order or scale packing puts whole sub-blocks out by about their size, far past
it. Values already on a type's grid (built from random fields by the format's formula) come back to the
bit, and quantizing them again gives the same bytes.

The bounds, with a the largest |x| of a sub-block (Q2_K: its range lo..hi, lo <= 0), A the block's, and
e(v) = max(v * 2**-11, 2**-25) the fp16 rounding of a scale v (subnormal scales included):

- Q2_K, each value (min/max fit, 4-bit sc and m): half a step of the sub-block, step = (hi - lo) / 3, plus
  what rounding its scale and minimum to d*sc and dmin*m moves the grid's ends: 1.5 d + dmin / 2 with
  d = max step / 15, dmin = max(-lo) / 15, and 50 e(d) + 16 e(dmin) for their fp16 rounding.
- Q3_K, RMS of a sub-block of 16: the fit is the least-squares best of scales that include a / 3 (the
  largest value on level 3, nothing clipped), so at most that grid's half step a / 6; plus rounding the
  scale to d*sc (|q| <= 4 steps of d / 2, d <= A / 93) and d to fp16: 2 A / 93 + 126 e(A / 93).
- IQ4_NL, RMS of a block: the best of scales that include a / 113 (nothing clipped), whose widest gap
  between kvalues is 24 steps: 12 a / 113; plus the fp16 rounding of that scale: 125 e(a / 113).
- IQ4_XS, RMS of a sub-block of 32: 12 a / 113 as IQ4_NL's, plus rounding the scale to d*sc (|kvalue|
  <= 127 steps of d / 2, d <= A / (89 * 31)) and d to fp16: 63.5 A / 2759 + 4000 e(A / 2759).
- MXFP4, each value (gguf's quantizer: d = 2**(floor(log2 A) - 3), levels 0..12 d): half its widest gap
  (8 d to 12 d), or what lies past 12 d: max(2 d, A - 12 d).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from pyplugin.ggml_types import SUPPORTED_TYPES
from pyplugin.model.synth_quant import quantize, random_blocks
from pyplugin.model.synth_quant_low import KVALUES

NEW_TYPES = (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4)
MXFP4_LEVELS = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), np.float32)  # doubled e2m1


def fp16_rounding(v: np.ndarray) -> np.ndarray:
    """How far rounding v to fp16 may move it: half an ulp, normal or subnormal."""
    return np.maximum(np.abs(v) * 2.0 ** -11, 2.0 ** -25)


def random_values(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """[n_blocks, block] normal values, each block of a magnitude from 0.01 to 100, its sub-blocks (16
    or 32 values) scaled down by up to ten each; one block all zeros and one with a zero sub-block."""
    rng = np.random.default_rng(seed)
    elements = GGML_QUANT_SIZES[qtype][0]
    group = 16 if qtype in (Q.Q2_K, Q.Q3_K) else 32
    x = rng.standard_normal((n_blocks, elements // group, group))
    x *= 10.0 ** rng.uniform(-1, 0, (n_blocks, elements // group, 1))
    x *= np.resize(10.0 ** np.arange(-2, 3), n_blocks)[:, None, None]
    x[0] = 0
    x[1, -1] = 0
    return x.reshape(n_blocks, elements).astype(np.float32)


def error_and_bound(qtype: Q, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(error, bound) arrays of the same shape: per value or per sub-block, as the module's docstring says."""
    x, err = x.astype(np.float64), np.abs(y.astype(np.float64) - x)
    if qtype == Q.MXFP4:
        amax = np.abs(x).max(-1, keepdims=True)
        d = np.where(amax > 0, 2.0 ** (np.floor(np.log2(np.where(amax > 0, amax, 1))) - 3), 0)
        return err, np.maximum(2 * d, amax - 12 * d) * (1 + 1e-6)
    group = 16 if qtype in (Q.Q2_K, Q.Q3_K) else 32
    sub, err = x.reshape(len(x), -1, group), err.reshape(len(x), -1, group)
    a = np.abs(sub).max(-1)                                                      # [n, sub-blocks]
    big = a.max(-1, keepdims=True)                                               # A, [n, 1]
    if qtype == Q.Q2_K:
        lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
        step = (hi - lo) / 3
        d, dmin = step.max(-1, keepdims=True) / 15, (-lo).max(-1, keepdims=True) / 15
        bound = step / 2 + 1.5 * d + dmin / 2 + 50 * fp16_rounding(d) + 16 * fp16_rounding(dmin)
        return err, bound[..., None] * (1 + 1e-6)
    rms = np.sqrt(np.square(err).mean(-1))
    if qtype == Q.Q3_K:
        bound = a / 6 + 2 * big / 93 + 126 * fp16_rounding(big / 93)
    elif qtype == Q.IQ4_NL:
        bound = 12 * a / 113 + 125 * fp16_rounding(a / 113)
    else:
        bound = 12 * a / 113 + 63.5 * big / 2759 + 4000 * fp16_rounding(big / 2759)
    return rms, bound * (1 + 1e-6)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_random_values_decode_within_the_formats_bound(qtype):
    x = random_values(qtype, 400, seed=int(qtype))
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (400, GGML_QUANT_SIZES[qtype][1])
    y = dequantize(raw, qtype)
    err, bound = error_and_bound(qtype, x, y)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"block {worst[0]}: error {err[worst]:.4g} past the bound {bound[worst]:.4g}"
    assert (y[0] == 0).all() and (y[1][x[1] == 0] == 0).all()  # zeros stay zeros
    # and the fit is worth its name: on the whole, well inside the worst case
    assert (err / np.maximum(bound, 1e-30)).mean() < 0.6


def grid_values(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """[n_blocks, block] values on qtype's grid, from random fields by gguf's formula, each sub-block with
    a quant at its outer level (Q2_K: both ends) and each block with a sub-block scale at its largest, so
    that the fit finds the same fields: Q2_K d*sc*q - dmin*m (sc 1..15, m 0..15, q 0..3); Q3_K d*sc*q
    (sc -31..31 but 0, q -4..3); IQ4_NL d*kvalue; IQ4_XS d*sc*kvalue; MXFP4 2**(e-128) * level (no -0)."""
    rng = np.random.default_rng(seed)
    n = n_blocks

    def fp16(lo: float, hi: float, shape, signed: bool = False) -> np.ndarray:
        v = 10.0 ** rng.uniform(lo, hi, shape) * (rng.choice([-1, 1], shape) if signed else 1)
        return v.astype(np.float16).astype(np.float32)

    def with_outer(q: np.ndarray, *levels: int) -> np.ndarray:
        """q [n, k, g] with each sub-block's first values set to `levels`, then shuffled within it."""
        q[..., :len(levels)] = levels
        return rng.permuted(q, axis=-1)

    def scales_with_a_largest(k: int, lo: int, top: int, signed: bool) -> np.ndarray:
        sc = rng.integers(lo, top + 1, (n, k)) * (rng.choice([-1, 1], (n, k)) if signed else 1)
        sc[np.arange(n), rng.integers(0, k, n)] = top * (rng.choice([-1, 1], n) if signed else 1)
        return sc.astype(np.float32)

    if qtype == Q.Q2_K:
        d, dmin = fp16(-3, -1, (n, 1)), fp16(-3, -1, (n, 1))
        sc, m = scales_with_a_largest(16, 1, 15, False), scales_with_a_largest(16, 0, 15, False)
        q = with_outer(rng.integers(0, 4, (n, 16, 16)), 0, 3).astype(np.float32)
        return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(n, 256)
    if qtype == Q.Q3_K:
        sc = scales_with_a_largest(16, 1, 31, True)
        q = with_outer(rng.integers(-4, 4, (n, 16, 16)), -4).astype(np.float32)
        return ((fp16(-4, -2, (n, 1), signed=True) * sc)[..., None] * q).reshape(n, 256)
    if qtype == Q.IQ4_NL:
        q = with_outer(rng.integers(0, 16, (n, 1, 32)), 0)
        return (fp16(-4, -1, (n, 1, 1), signed=True) * KVALUES[q]).reshape(n, 32)
    if qtype == Q.IQ4_XS:
        sc = scales_with_a_largest(8, 1, 31, True)
        q = with_outer(rng.integers(0, 16, (n, 8, 32)), 0)
        return ((fp16(-5, -3, (n, 1), signed=True) * sc)[..., None] * KVALUES[q]).reshape(n, 256)
    index = with_outer(rng.choice(np.r_[0:8, 9:16], (n, 1, 32)), rng.choice([7, 15]))
    return (2.0 ** rng.integers(-30, 10, (n, 1, 1)) * MXFP4_LEVELS[index]).astype(np.float32).reshape(n, 32)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_values_on_a_types_grid_come_back_exactly_and_requantize_to_the_same_bytes(qtype):
    """Dequantize (the format's formula) -> quantize -> dequantize: every bit back, and the blocks are a
    fixed point of quantizing what gguf decodes from them."""
    x = grid_values(qtype, 300, seed=int(qtype) + 1)
    raw = quantize(x, qtype)
    y = dequantize(raw, qtype)
    bad = np.argwhere(y != x)
    assert bad.size == 0, f"{len(bad)} values differ, first at {bad[0]}: {y[tuple(bad[0])]!r} vs {x[tuple(bad[0])]!r}"
    np.testing.assert_array_equal(quantize(y, qtype), raw)


def test_requantizing_what_gguf_decodes_from_iq4_nl_blocks_gives_the_same_bytes():
    """IQ4_NL's fit tries the scale it wrote, whatever the values: a block's largest decoded value sits on
    one of the levels tried (-127, 113, -104 or 89, whichever side it is on). The types with sub-block
    scales promise it only for values on their grid (above): rounding a small sub-block's scale to d*sc
    can move its largest value to an inner level, and Q2_K's min/max fit moves with the decoded range."""
    raw = quantize(random_values(Q.IQ4_NL, 400, seed=7), Q.IQ4_NL)
    np.testing.assert_array_equal(quantize(dequantize(raw, Q.IQ4_NL), Q.IQ4_NL), raw)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_rows_must_be_whole_blocks(qtype):
    elements = GGML_QUANT_SIZES[qtype][0]
    with pytest.raises(ValueError, match=rf"{qtype.name} needs rows that are a multiple of {elements} values"):
        quantize(np.zeros((2, elements + 16), np.float32), qtype)


@pytest.mark.parametrize("qtype", [Q(t) for t in SUPPORTED_TYPES if Q(t) not in (Q.F32, Q.F16, Q.BF16)],
                         ids=lambda t: t.name)
def test_random_blocks_decode_to_values_of_about_the_std_asked(qtype):
    """random_blocks (the large benchmark files) writes each scale field where gguf reads it: values decode
    finite, centred, with an RMS within 10% of `std` at two scales fifty times apart (MXFP4's power-of-two
    scale: within a factor of sqrt(2)). A scale written elsewhere leaves random bytes where gguf reads it."""
    elements = GGML_QUANT_SIZES[qtype][0]
    for std in (0.02, 1.0):
        y = dequantize(random_blocks(qtype, 64, 4 * elements, np.random.default_rng(3), std), qtype)
        assert np.isfinite(y).all()
        rms, spread = np.sqrt(np.square(y, dtype=np.float64).mean()), np.sqrt(2) if qtype == Q.MXFP4 else 1.1
        assert std / spread <= rms <= std * spread, (std, rms)
        assert abs(y.mean()) < 0.2 * std

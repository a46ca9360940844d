"""The quantized-tensor kernels (native/cuda/dequantize.cu, matvec.cu) against gguf-py's own dequantize.

For every supported type, on random blocks, blocks with extreme scales (fp16 max, smallest normal and
subnormals, negative; MXFP4's exponent byte at its ends), blocks quantized from random values and all-zero
blocks: pebble_dequantize equals gguf's dequantize rounded to fp16, and pebble_matvec a float64 product
of gguf's dequantized weights with the same fp16 vectors. Runs on the stub's numpy kernels and the host
library in `make test` (the host library under ASan/UBSan too, in `make test-sanitized`), and on the cuda
library where a GPU is present.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES

from helpers import quantizes_x, store_backend_params
from pyplugin.ggml_types import SUPPORTED_TYPES
from pyplugin.model.synth_quant import quantize as synth_quantize
from pyplugin.store import backend_named, native, probe
from pyplugin.errors import InvalidArgumentError, SizeMismatchError

TYPES = [Q(t) for t in SUPPORTED_TYPES]
QUANTIZED = set(TYPES) - {Q.F32, Q.F16, Q.BF16}
BLOCKS_OF_256 = {t for t in QUANTIZED if GGML_QUANT_SIZES[t][0] == 256}  # Q2_K..Q6_K, IQ4_XS
GGUF_QUANTIZES = {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4}  # gguf-py's quantizer; synth's for the others

# Where each quantized block keeps its fp16 scales (d; with m or dmin after it where the type has one).
# MXFP4 has none: its scale is an E8M0 exponent, byte 0 (MXFP4_EXPONENT).
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
                 Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
                 Q.MXFP4: ()}
MXFP4_EXPONENT = 0
# E8M0 exponents at their ends: 2**-129 and 2**-128 (float32 subnormals), 2**-127, 2**126 and 2**127 (whose
# 12 overflows float32), and around one.
EXTREME_EXPONENTS = np.array([0, 1, 2, 254, 255, 126, 127, 128], dtype=np.uint8)
# fp16 max, smallest normal, largest and smallest subnormal, each signed; one; minus zero.
EXTREME_HALVES = np.array([0x7BFF, 0xFBFF, 0x0400, 0x8400, 0x03FF, 0x83FF, 0x0001, 0x8001, 0x3C00, 0x8000],
                          dtype=np.uint16)
# float32 values at fp16's edges: the largest half, the rounding boundary to inf, the subnormal range
# and its rounding ties, float32 subnormals, infinities.
EDGE_FLOATS = np.array([65504, 65519.996, 65520, -65520, 3.4e38, 2**-14, 2**-14 * (1 - 2**-12), 2**-24,
                        2**-25, -(2**-25), 2**-25 * (1 + 2**-20), 3 * 2**-26, 5 * 2**-26, 1e-45, 0.0, -0.0,
                        np.inf, -np.inf], dtype=np.float32)

# matvec: |y - reference| <= MATVEC_RTOL * ||W[r]|| * ||x[v]|| for every output: float32 products and
# sums over a few thousand columns are far inside it; a wrong element, scale or row is far outside.
MATVEC_RTOL = 1e-5


def activation_blocks(qtype: Q) -> int:
    """The elements per 8-bit block the host library quantizes x to for weights of `qtype` (pebble.h:
    256 for the types of 256-element blocks, 32 for the other quantized types); 0 where x stays float."""
    if qtype not in QUANTIZED:
        return 0
    return 256 if qtype in BLOCKS_OF_256 else 32


def quantized_activation(x: np.ndarray, n: int) -> np.ndarray:
    """x (fp16) as the host library quantizes it, dequantized again: per block of n elements,
    d = max|x| / 127 and q = round(x / d), in float32 (pebble.h, "quantized tensors")."""
    v = x.astype(np.float32).reshape(-1, n)
    d = np.abs(v).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(v * inv) * d).reshape(x.shape)


def activation_rtol(qtype: Q) -> float:
    """How far quantizing x may move a product, relative to ||W[r]|| * ||x||: each element moves by at
    most d / 2 = max|x_block| / 254, so ||x - x_q|| <= sqrt(n) / 254 * ||x|| for blocks of n elements
    (Cauchy-Schwarz). That bound is 0.022 for 32-element blocks and 0.063 for 256; random vectors sit
    about twenty times inside it."""
    n = activation_blocks(qtype)
    return np.sqrt(n) / 254 if n else 0.0


@pytest.fixture(params=store_backend_params())
def backend(request) -> str:
    return request.param


def kernels_of(backend: str):
    return backend_named(backend).kernels


def to_numpy(a) -> np.ndarray:
    return a.get() if type(a).__module__.partition(".")[0] == "cupy" else np.asarray(a)


# ---------------------------------------------------------------------------------------------------
# test tensors


def finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random fp16 bit patterns, never inf or NaN (an all-ones exponent loses its top bit)."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits).astype(np.uint16)


def quantized_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator, kind: str) -> np.ndarray:
    """n_blocks blocks of `qtype` as bytes. Any payload is a valid block; only the fp16 scales are
    chosen, finite: "random" small ones, "random_bits" any finite half, "extreme" EXTREME_HALVES (with
    every other block's payload or sub-block scales at their extremes too), "quantized" gguf's own
    quantizer (synth's where gguf-py has none) on random values, "zero" all zero bytes. MXFP4's E8M0
    exponent: "random" around 127 (scales 2**-8..2**2), "random_bits" any byte, "extreme"
    EXTREME_EXPONENTS."""
    elements, nbytes = GGML_QUANT_SIZES[qtype]
    if kind == "zero":
        return np.zeros(n_blocks * nbytes, dtype=np.uint8)
    if kind == "quantized":
        magnitude = 10.0 ** rng.uniform(-3, 3, (n_blocks, 1))
        values = (rng.standard_normal((n_blocks, elements)) * magnitude).astype(np.float32)
        quantize = gguf_quants.quantize if qtype in GGUF_QUANTIZES else synth_quantize
        return quantize(values, qtype).reshape(-1)
    blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    if qtype == Q.MXFP4:
        exponents = {"random": rng.integers(120, 131, n_blocks, dtype=np.uint8),
                     "random_bits": blocks[:, MXFP4_EXPONENT], "extreme": np.resize(EXTREME_EXPONENTS, n_blocks)}
        blocks[:, MXFP4_EXPONENT] = exponents[kind]
    for i, offset in enumerate(SCALE_OFFSETS[qtype]):
        if kind == "random":
            halves = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint16)
        elif kind == "random_bits":
            halves = finite_halves(rng, n_blocks)
        else:  # extreme: d and dmin walk the list out of step, so blocks pair different extremes
            halves = np.resize(np.roll(EXTREME_HALVES, 3 * i), n_blocks)
        blocks[:, offset:offset + 2] = halves.astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    if kind == "extreme":
        odd = blocks[1::2]
        if qtype == Q.Q8_0:
            odd[:, 2:] = np.resize(np.array([0x80, 0x7F], np.uint8), 32)  # -128, 127
        elif qtype == Q.Q4_0:
            odd[:, 2:] = 0x0F                                              # 15 and 0: 7d and -8d
        elif qtype == Q.Q4_1:
            odd[:, 4:] = 0xF0                                              # 0 and 15: m and 15d + m
        elif qtype in (Q.Q5_0, Q.Q5_1):
            start = 2 if qtype == Q.Q5_0 else 4
            odd[:, start:start + 4] = 0xFF                                 # every fifth bit set
            odd[:, start + 4:] = 0x0F                                      # 31 and 16
        elif qtype in (Q.Q4_K, Q.Q5_K):
            odd[:, 4:16] = 0xFF                                            # every scale and min 63
            if qtype == Q.Q5_K:
                odd[:, 16:48] = 0xAA                                       # fifth bits of odd sub-blocks
        elif qtype == Q.Q6_K:
            odd[:, 192:208] = np.resize(np.array([0x80, 0x7F], np.uint8), 16)  # scales -128, 127
        elif qtype == Q.Q2_K:
            odd[:, :16] = 0xFF                                             # every scale and min 15
            odd[:, 16:80] = np.resize(np.array([0x00, 0xFF], np.uint8), 64)  # q 0 and 3
        elif qtype == Q.Q3_K:
            odd[:, :108] = np.resize(np.array([0x00, 0xFF], np.uint8), 108)  # q -4 and 3; scales -32, 31
        elif qtype == Q.IQ4_NL:
            odd[:, 2:] = 0xF0                                              # kvalues -127 and 113
        elif qtype == Q.MXFP4:
            odd[:, 1:] = 0xF7                                              # 12 and -12 halves of the scale
        else:  # IQ4_XS: sub-blocks 0..3 at scale 31, 4..7 at -32; nibbles 0 and 15 (kvalues -127, 113)
            odd[:, 2:8] = np.array([0xFF, 0x00, 0xFF, 0xFF, 0x00, 0x00], np.uint8)
            odd[:, 8:] = 0xF0
    return blocks.reshape(-1)


def float_elements(qtype: Q, n: int, rng: np.random.Generator, kind: str) -> np.ndarray:
    """n elements of F32, F16 or BF16 as bytes: "random" normal values over many decades (within fp16's
    range for F16), "extreme" values at fp16's edges and random bit patterns (infinities included),
    "zero" zeros."""
    if kind == "zero":
        return np.zeros(n * GGML_QUANT_SIZES[qtype][1], dtype=np.uint8)
    if kind == "random":
        decades = rng.uniform(-6, 4 if qtype == Q.F16 else 6, n)
        values = (rng.standard_normal(n) * 10.0 ** decades).astype(np.float32)
    else:
        bits = rng.integers(0, 1 << 32, n, dtype=np.uint32)
        bits = np.where((bits & 0x7F800000) == 0x7F800000, bits & 0xBFFFFFFF, bits)  # no NaN
        values = bits.astype(np.uint32).view(np.float32)
        values[:len(EDGE_FLOATS)] = EDGE_FLOATS
    if qtype == Q.F32:
        return values.view(np.uint8)
    if qtype == Q.BF16:  # the top half of each float32 (EDGE_FLOATS keep their meaning or neighbours)
        return (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    if kind == "random":
        return values.astype(np.float16).view(np.uint8)
    halves = finite_halves(rng, n)
    halves[:len(EXTREME_HALVES) + 2] = np.concatenate([EXTREME_HALVES, [0x7C00, 0xFC00]])  # and +-inf
    return halves.view(np.uint8)


def make_raw(qtype: Q, n_blocks: int, rng: np.random.Generator, kind: str) -> np.ndarray:
    if qtype in QUANTIZED:
        return quantized_blocks(qtype, n_blocks, rng, kind)
    return float_elements(qtype, n_blocks, rng, kind)


def kinds_for(qtype: Q) -> list[str]:
    if qtype in QUANTIZED:
        return ["random", "random_bits", "extreme", "zero", "quantized"]
    return ["random", "extreme", "zero"]


def reference(qtype: Q, raw: np.ndarray, n_rows: int = 1) -> np.ndarray:
    """gguf's float32 dequantization, [n_rows, n_cols]."""
    return gguf_quants.dequantize(raw.reshape(n_rows, -1), qtype)


def fp16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance between fp16 arrays in units in the last place (+0 and -0 are one point)."""
    def ordered(h):
        bits = h.view(np.uint16).astype(np.int64)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


# ---------------------------------------------------------------------------------------------------
# blocks


@pytest.mark.parametrize("qtype", list(Q), ids=lambda t: t.name)
def test_type_block_is_gguf_block_for_supported_types_and_an_error_otherwise(backend, qtype):
    if qtype.value in SUPPORTED_TYPES:
        assert kernels_of(backend).type_block(qtype) == GGML_QUANT_SIZES[qtype]
        assert SUPPORTED_TYPES[qtype.value] == qtype.name
    else:
        with pytest.raises(InvalidArgumentError, match=rf"type {qtype.value} \({qtype.name}\) has no kernels"):
            kernels_of(backend).type_block(qtype)


# ---------------------------------------------------------------------------------------------------
# dequantize


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_rounded_to_fp16(backend, qtype):
    elements = GGML_QUANT_SIZES[qtype][0]
    n_blocks = 24 if qtype in QUANTIZED else 4096
    for seed, kind in enumerate(kinds_for(qtype)):
        raw = make_raw(qtype, n_blocks, np.random.default_rng(seed), kind)
        with np.errstate(over="ignore"):  # extreme scales overflow fp16, as they should: to inf
            want = reference(qtype, raw).reshape(-1).astype(np.float16)
        got = to_numpy(kernels_of(backend).dequantize(qtype, raw, n_blocks * elements))
        assert got.dtype == np.float16 and got.shape == want.shape
        # Both decode in float32 and round that to fp16: on the host the very same operations, so every
        # bit equals gguf's; on a GPU fp16 rounding may differ by one unit in the last place at most.
        ulps = fp16_ulps(got, want)
        bad = np.flatnonzero(ulps > (0 if backend != "cuda" else 1))
        assert bad.size == 0, (f"{kind}: {bad.size} elements differ, first {bad[0]}: "
                               f"{got[bad[0]]!r} vs {want[bad[0]]!r}")
        if backend != "cuda":
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=kind)
        if kind == "zero":  # +-0: Q4_0's zero block is (0 - 8) * 0.0 = -0.0, in gguf too
            assert (got == 0).all()


def test_dequantize_f16_keeps_every_bit(backend):
    halves = np.arange(1 << 16, dtype=np.uint16)  # every pattern, NaNs included
    got = to_numpy(kernels_of(backend).dequantize(Q.F16, halves.view(np.uint8), halves.size))
    np.testing.assert_array_equal(got.view(np.uint16), halves)


def test_dequantize_writes_into_out(backend):
    raw = make_raw(Q.Q4_K, 2, np.random.default_rng(7), "random")
    xp = np if backend != "cuda" else pytest.importorskip("cupy")
    out = xp.full(512, np.nan, dtype=np.float16)
    assert kernels_of(backend).dequantize(Q.Q4_K, raw, 512, out=out) is out
    np.testing.assert_array_equal(to_numpy(out), reference(Q.Q4_K, raw).reshape(-1).astype(np.float16))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf_in_float32(backend, qtype):
    """The embedding's gather (pebble_dequantize_rows, on the CPU in either library): rows picked from a table
    of every kind of block, repeated and out of order, each bit of gguf's float32 (NaN where gguf's is)."""
    blocks, rng = (3 if qtype in QUANTIZED else 96), np.random.default_rng(31)
    kinds = kinds_for(qtype)
    table = np.stack([make_raw(qtype, blocks, rng, kinds[r % len(kinds)]) for r in range(2 * len(kinds) + 1)])
    n_cols, ids = blocks * GGML_QUANT_SIZES[qtype][0], [len(table) - 1, 0, 3, len(table) - 1, 1]
    with np.errstate(all="ignore"):  # extreme scales: inf, and NaN where gguf's decoding gives it too
        want = reference(qtype, table, len(table)).astype(np.float32)[ids]
    got = kernels_of(backend).lib.dequantize_rows(qtype, table, n_cols, ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), n_cols)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(np.where(nan, 0, got.view(np.uint32)), np.where(nan, 0, want.view(np.uint32)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_of_a_one_row_table(backend, qtype):
    """A table of one row of one block: Q2_K's holds 256 elements in 84 bytes, more than two a byte (the
    output was once sized for at most two, and the library wrote a row into none)."""
    raw = make_raw(qtype, 1, np.random.default_rng(41), kinds_for(qtype)[0]).reshape(1, -1)
    n_cols = GGML_QUANT_SIZES[qtype][0]
    with np.errstate(all="ignore"):
        want = reference(qtype, raw).astype(np.float32)
    got = kernels_of(backend).lib.dequantize_rows(qtype, raw, n_cols, [0, 0])
    assert got.shape == (2, n_cols)
    np.testing.assert_array_equal(got, np.concatenate([want, want]))


def test_dequantize_rows_refuses_rows_past_the_table_and_partial_rows(backend):
    lib = kernels_of(backend).lib
    raw, n_cols = matvec_case(Q.Q4_K, 3, 2, seed=5)  # 3 rows of 512 elements, 288 bytes each
    table = raw.reshape(3, -1)
    for ids, row in (([0, 3], r"rows\[1\] is 3"), ([-1], r"rows\[0\] is -1")):
        with pytest.raises(InvalidArgumentError, match=rf"pebble_dequantize_rows: Q4_K: {row}; the table has rows 0..2"):
            lib.dequantize_rows(Q.Q4_K, table, n_cols, ids)
    with pytest.raises(SizeMismatchError, match=r"Q4_K: n_cols 500 is not a multiple of the 256-element block"):
        lib.dequantize_rows(Q.Q4_K, table, 500, [0])
    with pytest.raises(SizeMismatchError, match=r"table_bytes 864 is not a whole number of 720-byte rows of 1280"):
        lib.dequantize_rows(Q.Q4_K, table, 1280, [0])
    with pytest.raises(InvalidArgumentError, match=r"n_cols must be at least 1 and n_rows at least 0, got 0 and 1"):
        lib.dequantize_rows(Q.Q4_K, table, 0, [0])
    with pytest.raises(InvalidArgumentError, match=r"GGUF type 16 \(IQ2_XXS\) has no kernels"):
        lib.dequantize_rows(Q.IQ2_XXS, table, n_cols, [0])
    assert lib.dequantize_rows(Q.Q4_K, table, n_cols, []).shape == (0, n_cols)
    with pytest.raises(InvalidArgumentError, match=r"rows\[0\] is 0; the table is empty \(table_bytes 0\)"):
        lib.dequantize_rows(Q.Q4_K, table[:0], n_cols, [0])
    np.testing.assert_array_equal(lib.dequantize_rows(Q.Q4_K, table, n_cols, [2]), reference(Q.Q4_K, raw, 3)[2:])


# ---------------------------------------------------------------------------------------------------
# matvec


def matvec_case(qtype: Q, n_rows: int, blocks_per_row: int, seed: int) -> tuple[np.ndarray, int]:
    """(raw, n_cols): row r of a kind taken in turn from those that keep float32 products finite (MXFP4's
    exponents held to 160 and below: 2**127 * 12 is past float32's range, as no fp16 scale is)."""
    kinds = kinds_for(qtype) if qtype in QUANTIZED else ["random", "zero"]
    rng = np.random.default_rng(seed)
    rows = [make_raw(qtype, blocks_per_row, rng, kinds[r % len(kinds)]) for r in range(n_rows)]
    raw = np.concatenate(rows)
    if qtype == Q.MXFP4:
        exponents = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, MXFP4_EXPONENT]
        np.minimum(exponents, 160, out=exponents)
    return raw, blocks_per_row * GGML_QUANT_SIZES[qtype][0]


@pytest.mark.parametrize("n_vec", [1, 3, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_matches_float64_product_of_gguf_weights(backend, qtype, n_vec):
    # 7 rows: not a whole number of the GPU's 4-row thread blocks; enough blocks per row that each lane
    # of a warp takes several parts.
    n_rows = 7
    raw, n_cols = matvec_case(qtype, n_rows, 101 if qtype not in QUANTIZED else 12 if qtype in BLOCKS_OF_256
                              else 70, seed=n_vec)
    x = np.random.default_rng(100 + n_vec).standard_normal((n_vec, n_cols)).astype(np.float16)
    weights = reference(qtype, raw, n_rows).astype(np.float64)  # [n_rows, n_cols]
    want = x.astype(np.float64) @ weights.T                      # [n_vec, n_rows]

    xp = np if backend != "cuda" else pytest.importorskip("cupy")
    out = xp.full((n_vec, n_rows), np.nan, dtype=np.float32)     # every output must be written
    got = to_numpy(kernels_of(backend).matvec(qtype, raw, n_rows, n_cols, x, out=out))
    assert not np.isnan(got).any(), f"outputs left unwritten at {np.argwhere(np.isnan(got)).tolist()}"
    norms = np.outer(np.linalg.norm(x.astype(np.float64), axis=1), np.linalg.norm(weights, axis=1))
    rtol = MATVEC_RTOL
    if quantizes_x(backend, qtype):
        # The library multiplies x quantized to 8-bit blocks: the product with that x exactly (up to
        # float32 sums), and within the documented bound of the product with x itself.
        x_q = quantized_activation(x, activation_blocks(qtype)).astype(np.float64)
        assert_within(got, x_q @ weights.T, MATVEC_RTOL * norms, "quantized x")
        rtol = activation_rtol(qtype) + MATVEC_RTOL
    assert_within(got, want, rtol * norms, "x")


INTEGER_TYPES = sorted(QUANTIZED)  # the GPU's integer kernel takes every one (x in 8-bit blocks, dp4a)


@pytest.mark.parametrize("n_vec", [1, 2, 3, 8])
@pytest.mark.parametrize("shape", ["9001 short rows", "37 rows of 20480"])
@pytest.mark.parametrize("qtype", INTEGER_TYPES + [Q.F16, Q.BF16, Q.F32], ids=lambda t: t.name)
def test_matvec_over_many_row_groups_and_rows_of_several_chunks(backend, qtype, shape, n_vec):
    """The GPU integer kernel's two loops, at each staging width (16384 elements at one or two vectors,
    4096 beyond): 9001 rows of one staging take several row groups a thread block (the blocks launched
    are those the GPU holds at once, a few thousand rows), and 20480-element rows take several stagings
    of x, at every vector count; every output written, each within the product's bounds. The dense types
    take the GPU's 8-element parts there (rows of whole parts, the matrix 16-byte aligned) over 2048-element
    stagings (their grid has a block for every 16 rows)."""
    blocks = 20480 // GGML_QUANT_SIZES[qtype][0] if shape.startswith("37") else 256 // GGML_QUANT_SIZES[qtype][0]
    n_rows = 37 if shape.startswith("37") else 9001
    raw, n_cols = matvec_case(qtype, n_rows, blocks, seed=n_vec + n_rows)
    x = np.random.default_rng(200 + n_vec).standard_normal((n_vec, n_cols)).astype(np.float16)
    weights = reference(qtype, raw, n_rows).astype(np.float64)
    xp = np if backend != "cuda" else pytest.importorskip("cupy")
    out = xp.full((n_vec, n_rows), np.nan, dtype=np.float32)
    got = to_numpy(kernels_of(backend).matvec(qtype, raw, n_rows, n_cols, x, out=out))
    assert_product(backend, qtype, got, x, weights)


@pytest.mark.parametrize("n_vec", [1, 3, 8])
@pytest.mark.parametrize("n_cols", [2056, 4104, 8])
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.F32], ids=lambda t: t.name)
def test_dense_matvec_with_a_short_last_staging(backend, qtype, n_cols, n_vec):
    """Dense rows whose last 2048-element staging holds one or a few of the GPU's 8-element parts (a lane's
    second part of a pair missing), and a row of one part."""
    raw, _ = matvec_case(qtype, 37, n_cols, seed=n_cols + n_vec)
    x = np.random.default_rng(300 + n_vec).standard_normal((n_vec, n_cols)).astype(np.float16)
    xp = np if backend != "cuda" else pytest.importorskip("cupy")
    out = xp.full((n_vec, 37), np.nan, dtype=np.float32)
    got = to_numpy(kernels_of(backend).matvec(qtype, raw, 37, n_cols, x, out=out))
    assert_product(backend, qtype, got, x, reference(qtype, raw, 37).astype(np.float64))


def assert_product(backend: str, qtype: Q, got: np.ndarray, x: np.ndarray, weights: np.ndarray) -> None:
    """Every output written, each within MATVEC_RTOL of its row's and vector's norms of the float64 product
    with x as the library takes it (in 8-bit blocks where it quantizes x)."""
    assert not np.isnan(got).any(), f"outputs left unwritten at {np.argwhere(np.isnan(got))[:10].tolist()}"
    norms = np.outer(np.linalg.norm(x.astype(np.float64), axis=1), np.linalg.norm(weights, axis=1))
    if quantizes_x(backend, qtype):
        x_q = quantized_activation(x, activation_blocks(qtype)).astype(np.float64)
        assert_within(got, x_q @ weights.T, MATVEC_RTOL * norms, "quantized x")
    else:
        assert_within(got, x.astype(np.float64) @ weights.T, MATVEC_RTOL * norms, "x")


def assert_within(got: np.ndarray, want: np.ndarray, tolerance: np.ndarray, what: str) -> None:
    excess = np.abs(got - want) - tolerance
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert (excess <= 0).all(), (f"against the product with {what}: [vector, row] {worst}: got {got[worst]}, "
                                 f"want {want[worst]}, tolerance {tolerance[worst]:.3g}")


def test_matvec_of_one_vector_returns_one_row_of_outputs(backend):
    raw, n_cols = matvec_case(Q.Q8_0, 5, 3, seed=11)
    x = np.random.default_rng(12).standard_normal(n_cols).astype(np.float16)
    got = to_numpy(kernels_of(backend).matvec(Q.Q8_0, raw, 5, n_cols, x))
    if quantizes_x(backend, Q.Q8_0):  # x quantized to 8-bit blocks, as pebble.h says
        x = quantized_activation(x, activation_blocks(Q.Q8_0))
    want = reference(Q.Q8_0, raw, 5).astype(np.float64) @ x.astype(np.float64)
    assert got.shape == (5,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------------
# malformed calls


def names(message: str, *values) -> bool:
    """Whether the message names every value as a whole word (so "68" does not match "680")."""
    return all(re.search(rf"(?<![\w.]){re.escape(str(v))}(?![\w])", message) for v in values)


def test_malformed_calls_raise_naming_type_and_sizes_and_the_library_stays_usable(backend):
    raw = make_raw(Q.Q8_0, 2, np.random.default_rng(3), "random")  # 64 elements, 68 bytes
    x = np.ones((1, 64), dtype=np.float16)

    def check_still_usable():
        got = to_numpy(kernels_of(backend).dequantize(Q.Q8_0, raw, 64))
        np.testing.assert_array_equal(got, reference(Q.Q8_0, raw).reshape(-1).astype(np.float16))

    cases = [
        (lambda: kernels_of(backend).dequantize(99, raw, 64), InvalidArgumentError, ("99",)),
        (lambda: kernels_of(backend).matvec(99, raw, 1, 64, x), InvalidArgumentError, ("99",)),
        (lambda: kernels_of(backend).dequantize(16, raw, 64), InvalidArgumentError, ("16", "IQ2_XXS")),
        (lambda: kernels_of(backend).matvec(16, raw, 1, 64, x), InvalidArgumentError, ("16", "IQ2_XXS")),
        (lambda: kernels_of(backend).dequantize(Q.Q8_0, raw, 48), SizeMismatchError, ("Q8_0", 48, 32)),
        (lambda: kernels_of(backend).matvec(Q.Q8_0, raw[:51], 1, 48, x[:, :48]), SizeMismatchError,
         ("Q8_0", "n_cols 48", 32)),
        (lambda: kernels_of(backend).dequantize(Q.Q8_0, raw[:-1], 64), SizeMismatchError, ("Q8_0", 68, 67)),
        (lambda: kernels_of(backend).dequantize(Q.Q8_0, np.append(raw, np.uint8(0)), 64), SizeMismatchError,
         ("Q8_0", 68, 69)),
        (lambda: kernels_of(backend).matvec(Q.Q8_0, raw[:-1], 1, 64, x), SizeMismatchError,
         ("Q8_0", 68, 67)),
        (lambda: kernels_of(backend).matvec(Q.Q8_0, raw, 1, 64, np.ones((0, 64), np.float16)),
         InvalidArgumentError, ("Q8_0", "n_vec 0", "1..8")),
        (lambda: kernels_of(backend).matvec(Q.Q8_0, raw, 1, 64, np.ones((9, 64), np.float16)),
         InvalidArgumentError, ("Q8_0", "n_vec 9", "1..8")),
        (lambda: kernels_of(backend).dequantize(Q.Q8_0, raw, 0), InvalidArgumentError, ("Q8_0", 0)),
    ]
    for call, error, named in cases:
        with pytest.raises(error) as caught:
            call()
        assert names(str(caught.value), *named), str(caught.value)
        check_still_usable()


def test_null_pointers_are_refused(backend):
    if backend == "stub":
        pytest.skip("the stub has no pointers to pass: its buffers are numpy arrays")
    kernels = backend_named(backend).kernels.lib
    lib, null = kernels._lib, native.ffi.NULL
    raw = make_raw(Q.Q4_0, 1, np.random.default_rng(5), "random")
    out = np.empty(32, np.float16)
    calls = [
        lambda: lib.pebble_dequantize(Q.Q4_0, null, 18, native.ffi.from_buffer("uint16_t[]", out), 32, null),
        lambda: lib.pebble_dequantize(Q.Q4_0, native.ffi.from_buffer(raw), 18, null, 32, null),
        lambda: lib.pebble_matvec(Q.Q4_0, null, 18, 1, 32, null, 1, null, null),
        lambda: lib.pebble_type_block(Q.Q4_0, null, null),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match="Q4_0.*NULL"):
            native._check(lib, call())
    assert kernels.type_block(Q.Q4_0) == (32, 18)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_stub_and_native_kernels_agree(qtype):
    """The stub is the reference semantics: on the same blocks, its results and the host library's are
    the same bits (dequantize) and the same float32 sums up to their order (matvec)."""
    if not probe("host").usable:
        pytest.skip("the host library is not built here (make host)")
    raw, n_cols = matvec_case(qtype, 5, 4 if qtype not in QUANTIZED else 2, seed=21)
    n = 5 * n_cols
    with np.errstate(over="ignore"):
        stub, host = (kernels_of(b).dequantize(qtype, raw, n) for b in ("stub", "host"))
    np.testing.assert_array_equal(stub.view(np.uint16), host.view(np.uint16))
    x = np.random.default_rng(22).standard_normal((3, n_cols)).astype(np.float16)
    stub, host = (kernels_of(b).matvec(qtype, raw, 5, n_cols, x) for b in ("stub", "host"))
    if not activation_blocks(qtype):
        np.testing.assert_allclose(stub, host, rtol=1e-5, atol=1e-6 * max(np.abs(host).max(), 1e-30))
    else:  # the host library quantizes x (the stub, like the GPU, multiplies x as it is): the documented bound
        weights = reference(qtype, raw, 5).astype(np.float64)
        norms = np.outer(np.linalg.norm(x.astype(np.float64), axis=1), np.linalg.norm(weights, axis=1))
        assert_within(host, stub, (activation_rtol(qtype) + MATVEC_RTOL) * norms, "x (the stub's)")


# The five reruns (each a process running the kernel tests, 10 to 25 s) are left to `make test-ci`.
@pytest.mark.parametrize("setting, error", [pytest.param({"PEBBLING_SIMD": "portable"}, None, marks=pytest.mark.ci),
                                            pytest.param({"PEBBLING_SIMD": "avx2"}, None, marks=pytest.mark.ci),
                                            pytest.param({"PEBBLING_SIMD": "gpu"}, None, marks=pytest.mark.ci),
                                            pytest.param({"PEBBLING_THREADS": "1"}, None, marks=pytest.mark.ci),
                                            pytest.param({"PEBBLING_THREADS": "3"}, None, marks=pytest.mark.ci),
                                            ({"PEBBLING_THREADS": "lots"}, "PEBBLING_THREADS is 'lots'"),
                                            ({"PEBBLING_SIMD": "sse9"}, "PEBBLING_SIMD is 'sse9'")])
def test_host_kernels_under_each_setting(setting, error):
    """The portable kernels (what a CPU without AVX2 runs), the AVX2 ones where the CPU has AVX-512, the
    GPU's integer and dense matvec kernels' code for a lane (PEBBLING_SIMD=gpu: each of 32 lanes on the host), and
    other pool sizes (a type of each kernel family: the split of rows among threads is the same for all) give
    results within the same bounds: the matvec and matmul tests above and below, run
    in a process with the setting; a malformed setting is an error naming it, not ignored."""
    if not probe("host").usable:
        pytest.skip("the host library is not built here (make host)")
    import os
    import subprocess
    import sys

    env = {**os.environ, **setting, "PEBBLING_TEST_BACKENDS": "host"}
    if error is None:
        selected = "host and (test_matvec or test_matmul or float32_vectors or stub_and_native) and not under_each"
        if "PEBBLING_THREADS" in setting:  # the pool's split, the same for every type: one of each kernel family
            selected += " and (Q8_0 or Q4_K or Q6_K or IQ4_XS or Q2_K or MXFP4 or F16)"
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selected]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert " passed" in done.stdout and "failed" not in done.stdout
    else:
        code = ("import numpy as np; from pyplugin.store import backend_named; "
                "backend_named('host').kernels.matvec(8, np.zeros(34, np.uint8), 1, 32, np.ones(32, np.float16))")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and error in done.stderr and "InvalidArgumentError" in done.stderr, done.stderr


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_takes_any_number_of_vectors_as_matvec_computes_them(backend, qtype):
    """pebble_matmul (a prefill chunk): 21 vectors, past matvec's 8 and not a whole number of the host's
    groups of 4, over 67 rows (several tiles); the same bounds as matvec's."""
    n_rows, n_vec = 67, 21
    raw, n_cols = matvec_case(qtype, n_rows, 33 if qtype not in QUANTIZED else 3 if qtype in BLOCKS_OF_256 else 9,
                              seed=5)
    x = np.random.default_rng(6).standard_normal((n_vec, n_cols)).astype(np.float16)
    weights = reference(qtype, raw, n_rows).astype(np.float64)
    xp = np if backend != "cuda" else pytest.importorskip("cupy")
    out = xp.full((n_vec, n_rows), np.nan, dtype=np.float32)
    got = to_numpy(kernels_of(backend).matmul(qtype, raw, n_rows, n_cols, x, out=out))
    assert_product(backend, qtype, got, x, weights)
    # and its rows are matvec's, group by group
    first = to_numpy(kernels_of(backend).matvec(qtype, raw, n_rows, n_cols, x[:8]))
    np.testing.assert_allclose(got[:8], first, rtol=1e-5, atol=1e-5 * max(np.abs(first).max(), 1e-30))


@pytest.mark.parametrize("kind", store_backend_params(("host", "stub")))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_gives_each_vector_the_bits_it_gets_alone(kind, qtype):
    """A sequence decoded in a batch gets the logits it gets alone, to the bit: each vector's products are
    the same whatever the vectors beside it (1..8 in matvec, 21 and 93 in matmul). 53 rows: three whole groups
    of the host's sixteen-row kernels (Q4_K, Q6_K on AVX-512) and five rows after them, which go row by row.
    93 vectors: a prompt's kernel where a type has one (IQ4_XS on AVX-512: 64 vectors a call, 16 at a time,
    then 29 as 16, 8 and 5). (The host and stub backends promise it; the CUDA kernels' batches are the GPU
    issue's.)"""
    n_rows = 53
    raw, n_cols = matvec_case(qtype, n_rows, 33 if qtype not in QUANTIZED else 3 if qtype in BLOCKS_OF_256 else 9,
                              seed=9)
    x = np.random.default_rng(10).standard_normal((93, n_cols)).astype(np.float16)
    kernels = kernels_of(kind)
    alone = np.stack([to_numpy(kernels.matvec(qtype, raw, n_rows, n_cols, x[v:v + 1]))[0] for v in range(93)])
    for n_vec in (2, 5, 8):
        np.testing.assert_array_equal(to_numpy(kernels.matvec(qtype, raw, n_rows, n_cols, x[:n_vec])), alone[:n_vec],
                                      err_msg=f"{n_vec} vectors")
    for n_vec in (21, 93):
        np.testing.assert_array_equal(to_numpy(kernels.matmul(qtype, raw, n_rows, n_cols, x[:n_vec])), alone[:n_vec],
                                      err_msg=f"{n_vec} vectors")


def test_matmul_refuses_no_vectors(backend):
    raw = make_raw(Q.Q8_0, 2, np.random.default_rng(3), "random")
    with pytest.raises(InvalidArgumentError) as caught:
        kernels_of(backend).matmul(Q.Q8_0, raw, 1, 64, np.ones((0, 64), np.float16))
    assert names(str(caught.value), "pebble_matmul", "Q8_0", "n_vec must be at least 1"), str(caught.value)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float32_vectors_are_rounded_to_fp16_by_the_library(backend, qtype):
    """pebble_matmul_f32 (what Kernels.matvec and matmul call with float32 vectors on the host and the
    stub): each element rounded to fp16 as numpy rounds it (fp16's edges, overflow to inf and float32
    subnormals included), then exactly what the fp16 call gives, bit for bit, for 1, 8 and 21 vectors."""
    kernels = kernels_of(backend)
    n_rows = 19
    raw, n_cols = matvec_case(qtype, n_rows, 33 if qtype not in QUANTIZED else 3 if qtype in BLOCKS_OF_256 else 9, seed=7)
    rng, w = np.random.default_rng(8), kernels._bytes(raw)
    for n_vec in (1, 8, 21):
        x = (rng.standard_normal((n_vec, n_cols)) * 30).astype(np.float32)
        x[0, :len(EDGE_FLOATS)] = EDGE_FLOATS
        with np.errstate(over="ignore"):
            halves = x.astype(np.float16)
        want = kernels.xp.zeros((n_vec, n_rows), np.float32)
        got = kernels.xp.full((n_vec, n_rows), 7.0, np.float32)
        kernels.lib.matmul(qtype, w, n_rows, n_cols, kernels.xp.asarray(halves), n_vec, want)
        kernels.lib.matmul_f32(qtype, w, n_rows, n_cols, kernels.xp.asarray(x), n_vec, got)
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
    x = rng.standard_normal((3, n_cols)).astype(np.float32)
    np.testing.assert_array_equal(to_numpy(kernels.matvec(qtype, raw, n_rows, n_cols, x)),
                                  to_numpy(kernels.matvec(qtype, raw, n_rows, n_cols, x.astype(np.float16))))
    with pytest.raises(SizeMismatchError, match="float32 vectors"):
        kernels.lib.matmul_f32(qtype, w, n_rows, n_cols, kernels.xp.asarray(x[:, :-1].copy()), 3,
                               kernels.xp.zeros((3, n_rows), np.float32))

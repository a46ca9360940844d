"""GGUF tensor types: the one list of those pebbling computes from, and their block layouts.

A leaf that every layer may import: the loader refuses files with other types, the stub's kernels
accept exactly these, synth writes them and the tests derive their cases from them. The native
library keeps its own list (native/cuda/quants.cuh); a test holds the two together.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

F32, F16 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16)

# Every type with kernels, by GGUF id.
SUPPORTED_TYPES: dict[int, str] = {int(t): t.name for t in sorted((
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.MXFP4))}
SUPPORTED_NAMES: tuple[str, ...] = tuple(SUPPORTED_TYPES.values())
SUPPORTED_TEXT = ", ".join(f"{k} {v}" for k, v in SUPPORTED_TYPES.items())  # as native/cuda/quants.cuh lists them

# numpy dtypes that are GGUF types as they are (vectors, caches, dense matrices).
DENSE_TYPES: dict[np.dtype, int] = {np.dtype(np.float32): F32, np.dtype(np.float16): F16}


def type_name(qtype: int) -> str:
    """The GGUF name of a type id ("Q4_K"), or "unknown" for an id gguf does not know."""
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return "unknown"


def block(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of GGUF type `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of `cols` elements of GGUF type `qtype`."""
    elements, nbytes = block(qtype)
    return cols // elements * nbytes

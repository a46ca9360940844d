"""Computing from quantized GGUF tensors with the native library's kernels (native/pebble_quant.cu):
dequantize to fp16 (prefill), and fused dequantize-and-multiply matrix-vector products (decode).

The kernels run in the selected backend's library (pyplugin.backend): on `host`, numpy arrays in and
out and the call is done when it returns; on `cuda`, CuPy arrays (host arrays are copied to the device
first) and the work is enqueued on CuPy's current stream. The pure-Python `stub` backend has no
kernels, so there every call raises PebblingError.
"""

from __future__ import annotations

import threading

import numpy as np

from .backend import select_backend
from .errors import InvalidArgumentError, PebblingError, SizeMismatchError
from .store import as_int
from .xp import array_module

# GGUF type id -> name, for the types with kernels.
SUPPORTED_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K", 30: "BF16"}

_kernels_lock = threading.Lock()
_kernels: dict = {}


def _open(backend: str | None):
    """(NativeKernels, xp) of the backend `backend` (None: the selected one)."""
    choice = select_backend(backend)
    if choice.name == "stub":
        raise PebblingError(
            "quantized kernels need the native library, but the backend is the pure-Python stub "
            f"({choice.reason}); build it with `make host` (or `make cuda` on a GPU machine)")
    with _kernels_lock:
        if choice.name not in _kernels:
            from ._native import NativeKernels

            _kernels[choice.name] = NativeKernels(choice.name)
        kernels = _kernels[choice.name]
    return kernels, array_module("cupy" if choice.name == "cuda" else "numpy")


def _stream(xp):
    return xp.cuda.get_current_stream() if xp is not np else None


def _raw_bytes(raw, xp):
    """`raw` as an array in xp's memory: CUDA arrays and numpy arrays as they are (copied to the device
    for cuda), any other buffer (bytes, memoryview, mmap) as uint8."""
    if not (isinstance(raw, np.ndarray) or hasattr(raw, "__cuda_array_interface__")):
        raw = np.frombuffer(raw, dtype=np.uint8)
    return raw if xp is np else xp.asarray(raw)


def _check_out(call: str, out, dtype, shape: tuple) -> None:
    if out.dtype != dtype:
        raise InvalidArgumentError(f"{call}: out must be {np.dtype(dtype)}, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise SizeMismatchError(f"{call}: out must have shape {shape}, got {tuple(out.shape)}")


def block_size(ggml_type, *, backend: str | None = None) -> tuple[int, int]:
    """(elements, bytes) of one block of `ggml_type` (an id or gguf's GGMLQuantizationType)."""
    kernels, _ = _open(backend)
    return kernels.type_block(ggml_type)


def dequantize(ggml_type, raw, n_elements: int, *, out=None, backend: str | None = None):
    """The `n_elements` elements of the tensor whose GGUF bytes are `raw`, as a flat float16 array
    (written into `out` when given). Values are decoded in float32 as gguf's dequantize does, then
    rounded to nearest even (out of fp16 range: +-inf)."""
    kernels, xp = _open(backend)
    n_elements = as_int(n_elements, "n_elements")
    if out is None:
        out = xp.empty(max(n_elements, 0), dtype=np.float16)
    else:
        _check_out("dequantize", out, np.float16, (n_elements,))
    kernels.dequantize(ggml_type, _raw_bytes(raw, xp), n_elements, out, stream=_stream(xp))
    return out


def matvec(ggml_type, w, n_rows: int, n_cols: int, x, *, out=None, backend: str | None = None):
    """W @ x for the n_rows x n_cols weight whose GGUF bytes are `w` (rows contiguous, as GGUF stores
    them): x is [n_cols] or [n_vec, n_cols] with n_vec in 1..8, cast to float16; returns float32
    [n_rows] or [n_vec, n_rows] (written into `out` when given). Products and sums are float32."""
    kernels, xp = _open(backend)
    n_rows, n_cols = as_int(n_rows, "n_rows"), as_int(n_cols, "n_cols")
    x = xp.ascontiguousarray(xp.asarray(x), dtype=np.float16)
    if x.ndim not in (1, 2) or x.shape[-1] != n_cols:
        raise SizeMismatchError(f"matvec: x must be [n_cols] or [n_vec, n_cols] with n_cols {n_cols}, "
                                f"got shape {tuple(x.shape)}")
    n_vec = 1 if x.ndim == 1 else x.shape[0]
    shape = (max(n_rows, 0),) if x.ndim == 1 else (n_vec, max(n_rows, 0))
    if out is None:
        out = xp.empty(shape, dtype=np.float32)
    else:
        _check_out("matvec", out, np.float32, shape)
    kernels.matvec(ggml_type, _raw_bytes(w, xp), n_rows, n_cols, x, n_vec, out, stream=_stream(xp))
    return out

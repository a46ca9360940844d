"""What the native bindings (native_kernels.py, native_decoder.py) share: a buffer's pointer and size for the
library, the bytes of a KV cache, and C ints checked on the way in."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ..ggml_types import DENSE_TYPES
from ..kv_types import KV_BY_GGML
from .abi import INT32_MAX, INT32_MIN
from .native import _DEVICE_MEMORY, _buffer, _c_int, ffi


def _pointer(obj, backend: str, writable: bool, name: str):
    """`_buffer` for the decode step's buffers, with fast paths for C-contiguous numpy arrays (host) and
    CuPy arrays (cuda)."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous and (obj.flags.writeable or not writable):
        return ffi.from_buffer(obj, require_writable=writable), obj.nbytes
    if _DEVICE_MEMORY[backend] and type(obj).__module__.startswith("cupy") and obj.flags.c_contiguous:
        return ffi.cast("void *", obj.data.ptr), obj.nbytes
    return _buffer(obj, backend, writable=writable, what=f"decoder {name}")


_ITEMSIZE = {ggml_type: dtype.itemsize for dtype, ggml_type in DENSE_TYPES.items()}  # F32 4, F16 2


def _kv_bytes(kv_type: int, heads: int, head_dim: int) -> int | None:
    """Bytes of a cache of `heads` heads of head_dim values of KV type kv_type (None: a type, or a head_dim
    of part of a block, that the library refuses with its own message)."""
    t = KV_BY_GGML.get(kv_type)
    return None if t is None or head_dim % t.block else heads * t.row_bytes(head_dim)


def _c_type(ggml_type) -> int:
    """A GGUF type id (an int or gguf's GGMLQuantizationType); whether it has kernels is the library's
    to judge."""
    return _int32(ggml_type, "ggml type")


def _int32(value, what: str) -> int:
    return _c_int(value, what, INT32_MIN, INT32_MAX, InvalidArgumentError, "does not fit in int32")

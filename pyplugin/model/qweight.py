"""A weight matrix kept in its GGUF form: the file's bytes, its type and its shape.

The forward pass multiplies by it without expanding it for good: a few rows at a time (decode) go
through the fused dequantize-and-multiply kernel, which reads each quantized byte once; a longer
chunk (prefill) expands the matrix into a reused fp16 workspace and multiplies that. The kernels come
in from outside (a store backend's, for the side the bytes live on): the model never chooses them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ..ggml_types import F16, F32, row_bytes, type_name
from ..xp import compute_dtype, get_array_module, to_numpy

Array = Any


@dataclass(eq=False)
class QuantWeight:
    """rows x cols elements of GGUF type `qtype`, each row a whole number of blocks, rows one after
    another as the file stores them. `shape` is numpy order, as for the dense weights: (out, in)."""

    qtype: int                      # GGUF type id (gguf's GGMLQuantizationType)
    shape: tuple[int, int]          # (rows, cols)
    data: Array                     # uint8 [rows, row_bytes], numpy or CuPy
    kernels: Any = None             # the kernels for data's side (pyplugin.store.Kernels); needed to compute

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if tuple(self.data.shape) != (rows, row_bytes(self.qtype, cols)):
            raise ValueError(f"{self.type_name} {rows} x {cols} weight needs bytes shaped "
                             f"{(rows, row_bytes(self.qtype, cols))}, got {tuple(self.data.shape)}")

    ndim = 2

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def size(self) -> int:
        """Elements, as for an array."""
        return self.shape[0] * self.shape[1]

    def __repr__(self) -> str:
        side = type(self.data).__module__.partition(".")[0]
        return f"QuantWeight({self.type_name}, {self.shape}, {self.nbytes} bytes on {side})"

    # -- where it lives

    def placed(self, data: Array, kernels: Any = None) -> "QuantWeight":
        """The same tensor over other bytes (a device copy, a store's view), computed by `kernels`."""
        return replace(self, data=data, kernels=kernels)

    def to(self, xp: Any, kernels: Any = None) -> "QuantWeight":
        """A copy whose bytes live in array module xp (the same object when they already do)."""
        if get_array_module(self.data) is xp and kernels in (None, self.kernels):
            return self
        return self.placed(xp.asarray(self.data), kernels)

    def split_rows(self, sizes: Sequence[int]) -> list["QuantWeight"]:
        """Consecutive row ranges of these sizes, as weights over views of the same bytes."""
        parts, start = [], 0
        for n in sizes:
            parts.append(replace(self, shape=(n, self.shape[1]), data=self.data[start:start + n]))
            start += n
        return parts

    def _kernels(self):
        if self.kernels is None:
            raise ValueError(f"{self!r} has no kernels to compute with: place it with kernels "
                             "(QuantWeight.placed or .to) before multiplying by it")
        return self.kernels

    # -- computing from it

    def take_rows(self, ids: Any) -> np.ndarray:
        """Rows `ids` as float32 on the host, as gguf decodes them (the embedding's gather): of host bytes, by
        the kernels' library (pebble_dequantize_rows, on the CPU whichever the library), else by gguf."""
        from .gguf_file import dequantize_bytes

        if self.kernels is not None and isinstance(self.data, np.ndarray):
            return self.kernels.lib.dequantize_rows(self.qtype, self.data, self.shape[1], ids)
        rows = to_numpy(self.data[np.asarray(ids, dtype=np.int64)])
        return dequantize_bytes(np.ascontiguousarray(rows), self.qtype, (rows.shape[0], self.shape[1]))

    def matmul(self, x: Array) -> Array:
        """x @ W.T for x [T, cols] or [cols], in x's dtype: the fused kernel for T up to its vector
        limit, else (on kernels with tiled_matmul) the stored blocks multiplied in tiles, else W
        expanded into the fp16 workspace and multiplied (cuBLAS on the GPU)."""
        kernels = self._kernels()
        rows, cols = self.shape
        n_vec = 1 if x.ndim == 1 else x.shape[0]
        if n_vec <= kernels.max_vec:
            return kernels.matvec(self.qtype, self.data, rows, cols, x).astype(x.dtype, copy=False)
        dense = self.dense_view()
        if dense is not None:  # already a float matrix the GEMM takes as it is: no expansion
            return x @ dense.T
        if getattr(kernels, "tiled_matmul", False):  # the host's kernels multiply the stored blocks in tiles
            return kernels.matmul(self.qtype, self.data, rows, cols, x).astype(x.dtype, copy=False)
        w = kernels.dequantize(self.qtype, self.data, rows * cols, out=kernels.workspace(rows * cols))
        return x @ w.reshape(rows, cols).T

    def dense_view(self) -> Array | None:
        """The bytes as a float matrix of the compute side, where they already are one: F16 anywhere,
        F32 on the host (whose compute type it is); else None, and prefill expands them."""
        if needs_expansion(self.qtype, compute_dtype(get_array_module(self.data))):
            return None
        dtype = np.float16 if self.qtype == F16 else np.float32
        return self.data.view(dtype).reshape(self.shape)


def needs_expansion(qtype: int, dtype: Any) -> bool:
    """Whether a prefill chunk expands a matrix of this type into the fp16 workspace where the compute
    type is `dtype`: F16 is multiplied as stored anywhere, F32 where the compute type is float32."""
    return not (qtype == F16 or (qtype == F32 and np.dtype(dtype) == np.float32))

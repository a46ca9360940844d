"""Computing from quantized GGUF tensors: dequantize to fp16 (prefill), fused dequantize-and-multiply
matrix-vector products, and the decode step of a whole model in one call.

`Kernels` puts one library of kernels behind the interface the model computes with: the native
library's (native/cuda/, and native/cpu/ in the host library) on `cuda` and `host`, numpy with gguf-py's
decoders on the pure-Python `stub` (stub_kernels.StubKernels, the same arguments accepted and
refused). A backend object makes them (pyplugin.store.backend); nothing here chooses one. Buffers live
in the kernels' array module `xp`: numpy arrays on `host` and `stub`, where a call is done when it
returns; CuPy arrays on `cuda` (host arrays are copied to the device first), the work enqueued on the
current stream.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..errors import InvalidArgumentError, SizeMismatchError
from ..xp import free_cached
from .abi import ACTIVATIONS, DECODE_WEIGHTS, DECODER_GRAPHS, GATINGS  # noqa: F401 - found here by others
from .interface import as_int
# The decode step's structs and its making (step_model.py), found here by others too.
from .step_model import (DECODER_STATS, EXPERT_MATRICES, EXPERT_POLICIES, Decoder, GraphPolicy,  # noqa: F401
                         LayerShape, StepLayer, StepModel, _kv_type, make_decoder, tensor_ref)


class Kernels:
    """A library of kernels (NativeKernels or StubKernels: `lib`), and the array module (`xp`) their
    buffers live in. `current_stream()` gives the stream to enqueue on (None: calls finish on return)."""

    def __init__(self, lib: Any, xp: ModuleType, current_stream: Callable[[], Any] = lambda: None):
        self.lib, self.xp, self._stream = lib, xp, current_stream
        self.name = lib.backend
        self.max_vec: int = lib.MAX_VEC  # the most vectors one matvec call takes
        # Whether a prefill chunk multiplies quantized weights as stored (matmul) rather than expanding
        # them into the fp16 workspace for a GEMM: the host library's tiled kernels beat numpy's GEMM
        # over an expanded matrix; cuBLAS on the GPU, and numpy on the stub, do better with the expansion.
        self.tiled_matmul: bool = lib.backend == "host"
        # Whether a decode step's attention runs through `attend` (one call for every sequence of a batch)
        # rather than array operations per sequence: on host memory (on a GPU not yet timed against CuPy's).
        self.attends: bool = lib.backend in ("host", "stub")
        # Whether float32 vectors go to the library as they are (it rounds them to fp16 with F16C, where numpy's
        # conversion is a scalar loop); CuPy converts them on the GPU.
        self.takes_float32: bool = lib.backend in ("host", "stub")
        self._local = threading.local()  # each thread's fp16 workspace and decode scratch
        self._scratch_bytes: dict[tuple, int] = {}  # (LayerShape, n_ctx) or ("attend", ...) -> scratch bytes

    def __repr__(self) -> str:
        return f"Kernels({self.name!r})"

    def _bytes(self, raw):
        """`raw` as an array in xp's memory: CUDA arrays and numpy arrays as they are (copied to the
        device for cuda), any other buffer (bytes, memoryview, mmap) as uint8."""
        if not (isinstance(raw, np.ndarray) or hasattr(raw, "__cuda_array_interface__")):
            raw = np.frombuffer(raw, dtype=np.uint8)
        return self.xp.asarray(raw)

    def type_block(self, ggml_type) -> tuple[int, int]:
        """(elements, bytes) of one block of `ggml_type` (an id or gguf's GGMLQuantizationType)."""
        return self.lib.type_block(ggml_type)

    def dequantize(self, ggml_type, raw, n_elements: int, *, out=None):
        """The `n_elements` elements of the tensor whose GGUF bytes are `raw`, as a flat float16 array
        (written into `out` when given). Values are decoded in float32 as gguf's dequantize does, then
        rounded to nearest even (out of fp16 range: +-inf)."""
        n_elements = as_int(n_elements, "n_elements")
        if out is None:
            out = self.xp.empty(max(n_elements, 0), dtype=np.float16)
        else:
            _check_out("dequantize", out, np.float16, (n_elements,))
        self.lib.dequantize(ggml_type, self._bytes(raw), n_elements, out, stream=self._stream())
        return out

    def _vectors(self, x):
        """x as the library takes it, C-contiguous: float32 where it rounds float32 vectors to fp16 itself
        (takes_float32), else rounded to fp16 here."""
        x = self.xp.asarray(x)
        if self.takes_float32 and x.dtype == np.float32:
            return self.xp.ascontiguousarray(x)
        return self.xp.ascontiguousarray(x, dtype=np.float16)

    def matvec(self, ggml_type, w, n_rows: int, n_cols: int, x, *, out=None):
        """W @ x for the n_rows x n_cols weight whose GGUF bytes are `w` (rows contiguous, as GGUF
        stores them): x is [n_cols] or [n_vec, n_cols] with n_vec in 1..8, cast to float16; returns
        float32 [n_rows] or [n_vec, n_rows] (written into `out` when given). Products and sums are
        float32."""
        xp = self.xp
        n_rows, n_cols = as_int(n_rows, "n_rows"), as_int(n_cols, "n_cols")
        x = self._vectors(x)
        if x.ndim not in (1, 2) or x.shape[-1] != n_cols:
            raise SizeMismatchError(f"matvec: x must be [n_cols] or [n_vec, n_cols] with n_cols {n_cols}, "
                                    f"got shape {tuple(x.shape)}")
        n_vec = 1 if x.ndim == 1 else x.shape[0]
        shape = (max(n_rows, 0),) if x.ndim == 1 else (n_vec, max(n_rows, 0))
        if out is None:
            out = xp.empty(shape, dtype=np.float32)
        else:
            _check_out("matvec", out, np.float32, shape)
        if x.dtype == np.float32 and 1 <= n_vec <= self.max_vec:  # rounded to fp16 by the library
            self.lib.matmul_f32(ggml_type, self._bytes(w), n_rows, n_cols, x, n_vec, out, stream=self._stream())
        else:
            self.lib.matvec(ggml_type, self._bytes(w), n_rows, n_cols, x.astype(np.float16, copy=False), n_vec, out,
                            stream=self._stream())
        return out

    def matmul(self, ggml_type, w, n_rows: int, n_cols: int, x, *, out=None):
        """As matvec for x [n_vec, n_cols] with any n_vec (pebble_matmul): a prefill chunk multiplied
        from the weights as stored."""
        xp = self.xp
        n_rows, n_cols = as_int(n_rows, "n_rows"), as_int(n_cols, "n_cols")
        x = self._vectors(x)
        if x.ndim != 2 or x.shape[-1] != n_cols:
            raise SizeMismatchError(f"matmul: x must be [n_vec, n_cols] with n_cols {n_cols}, got shape "
                                    f"{tuple(x.shape)}")
        shape = (x.shape[0], max(n_rows, 0))
        if out is None:
            out = xp.empty(shape, dtype=np.float32)
        else:
            _check_out("matmul", out, np.float32, shape)
        call = self.lib.matmul_f32 if x.dtype == np.float32 else self.lib.matmul  # float32: rounded by the library
        call(ggml_type, self._bytes(w), n_rows, n_cols, x, x.shape[0], out, stream=self._stream())
        return out

    def workspace(self, n_elements: int):
        """A flat float16 array of n_elements, a view of this thread's reused workspace (kept until
        `release_workspace`); it grows to the largest size asked for, the old one given back first:"""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.size < n_elements:
            self._local.buffer = None  # to the device, from CuPy's pool too (NVML counts what it keeps)
            free_cached(self.xp)
            buffer = self._local.buffer = self.xp.empty(n_elements, dtype=np.float16)
        return buffer[:n_elements]

    def release_workspace(self) -> None:
        """Drops this thread's workspace (a request that needs one allocates it again)."""
        self._local.buffer = None

    def decoder(self, cfg, layers, caches, outer, n_ctx: int, **options) -> Decoder:
        """The decode step of a model over these weights and caches (pebble_decoder_create): step_model.make_decoder,
        whose docstring says what each argument is."""
        return make_decoder(self, cfg, layers, caches, outer, n_ctx, **options)

    def attend(self, q, caches, n_pos, n_head_kv: int, scale: float, softcap: float = 0.0, new=None):
        """Attention of one query per sequence over its own cache (pebble_attend): q [B, n_head, head_dim]
        (rotated, not yet scaled), caches B (k, v) pairs [rows, n_head_kv, width] of one KV type
        (float32 or float16), n_pos the rows each attends over. `new`: the new tokens' (k, v) rows
        [B, n_head_kv, head_dim], written into row n_pos[b] - 1 of each sequence's caches first (None: the
        rows are already there). Returns float32 [B, n_head * head_dim]; each row is the same whatever
        the others."""
        xp = self.xp
        q = xp.ascontiguousarray(q, dtype=np.float32)
        n_seq, n_head, head_dim = q.shape
        n_rows = caches[0][0].shape[0]
        kv_type = _kv_type("attend", caches[0][0], head_dim)
        rows = {}
        if new is not None:
            rows = {name: xp.ascontiguousarray(a, dtype=np.float32).reshape(n_seq, -1)
                    for name, a in zip(("k_new", "v_new"), new)}
        need = self._scratch_bytes.get(("attend", n_seq, n_head, n_rows))
        if need is None:  # asked once per batch size and cache length: a decode step attends every layer
            need = self._scratch_bytes["attend", n_seq, n_head, n_rows] = self.lib.attend_scratch_bytes(n_seq, n_head,
                                                                                                          n_rows)
        scratch = getattr(self._local, "attend_scratch", None)
        if scratch is None or scratch.nbytes < need:
            scratch = self._local.attend_scratch = xp.empty(max(need, 1), dtype=np.uint8)
        out = xp.empty((n_seq, n_head * head_dim), dtype=np.float32)
        self.lib.attend(q.reshape(n_seq, n_head * head_dim), kv_type, [k for k, _ in caches], [v for _, v in caches],
                        n_pos, n_rows, n_head, n_head_kv, head_dim, float(scale), float(softcap), out,
                        scratch[:max(need, 1)], stream=self._stream(), **rows)
        return out

    def attend_prompt(self, q, cache, pos: int, n_head_kv: int, scale: float, softcap: float = 0.0,
                      window: int = 0, sinks=None):
        """Causal attention of a prompt chunk (pebble_attend_prompt): q [T, n_head, head_dim] (rotated, not
        yet scaled) at positions pos..pos + T - 1 over rows 0..pos + T - 1 of one sequence's (k, v) caches
        [rows, n_head_kv, width] (its own rows already written); a query sees the keys at and before it,
        within `window` of it where window > 0; `sinks` [n_head] (gpt-oss) join each head's softmax. Returns
        float32 [T, n_head * head_dim]."""
        xp = self.xp
        q = xp.ascontiguousarray(q, dtype=np.float32)
        n_tok, n_head, head_dim = q.shape
        k_cache, v_cache = cache
        kv_type = _kv_type("attend_prompt", k_cache, head_dim)
        out = xp.empty((n_tok, n_head * head_dim), dtype=np.float32)
        self.lib.attend_prompt(q.reshape(n_tok, n_head * head_dim), kv_type, k_cache, v_cache, int(pos),
                               k_cache.shape[0], n_head, n_head_kv, head_dim, int(window), float(scale),
                               float(softcap), out, stream=self._stream(),
                               sinks=None if sinks is None else xp.ascontiguousarray(sinks, dtype=np.float32))
        return out

def _check_out(call: str, out, dtype, shape: tuple) -> None:
    if out.dtype != dtype:
        raise InvalidArgumentError(f"{call}: out must be {np.dtype(dtype)}, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise SizeMismatchError(f"{call}: out must have shape {shape}, got {tuple(out.shape)}")

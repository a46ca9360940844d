"""Bindings to the native library's quantized-tensor kernels and attention (the "quantized tensors" section
of native/pebble.h), over the declarations native.py reads from the header; its decode step is built by
native_decoder.py.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..errors import InvalidArgumentError, SizeMismatchError
from ..ggml_types import SUPPORTED_TYPES, block
from .abi import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN
from .interface import check_attend_counts, host_buffer, stream_pointer
from .native import _buffer, _c_int, _check, ffi, load_library
from .native_buffers import _c_type, _kv_bytes, _pointer
from .native_decoder import NativeDecoder

# The most elements a byte of any type holds (Q2_K: 256 in 84 bytes): a table of n bytes has no row longer.
_ELEMENTS_PER_BYTE = max(elements / nbytes for elements, nbytes in map(block, SUPPORTED_TYPES))


class NativeKernels:
    """The quantized-tensor kernels of the native library `kind` (see "quantized tensors" in pebble.h).

    Buffers are host buffers (numpy arrays, bytes-like) on the host library and CUDA arrays on the cuda
    one, where the calls are enqueued on `stream` (see pyplugin.store.interface.stream_pointer). The library
    judges types and counts; the sizes of `out` and `x`, which it cannot see, are checked here.
    """

    def __init__(self, kind: str = "host"):
        self._lib, self.library_path = load_library(kind)
        self.backend = kind
        self.MAX_VEC = self._lib.PEBBLE_MATVEC_MAX_VEC

    def type_block(self, ggml_type) -> tuple[int, int]:
        """(elements, bytes) of one block of `ggml_type`."""
        elements, nbytes = ffi.new("int64_t *"), ffi.new("int64_t *")
        _check(self._lib, self._lib.pebble_type_block(_c_type(ggml_type), elements, nbytes))
        return int(elements[0]), int(nbytes[0])

    def dequantize(self, ggml_type, src, n_elements, out, *, stream=None) -> None:
        """out (n_elements fp16) = the tensor whose GGUF bytes are `src`."""
        ggml_type = _c_type(ggml_type)
        n_elements = _c_int(n_elements, "n_elements", INT64_MIN, INT64_MAX, InvalidArgumentError,
                            "does not fit in int64")
        src_ptr, src_bytes = _buffer(src, self.backend, writable=False, what="dequantize src")
        dst_ptr, dst_bytes = _buffer(out, self.backend, writable=True, what="dequantize out")
        if n_elements > 0 and dst_bytes != 2 * n_elements:
            raise SizeMismatchError(f"dequantize: out holds {dst_bytes} bytes; {n_elements} fp16 elements "
                                    f"need {2 * n_elements}")
        _check(self._lib, self._lib.pebble_dequantize(ggml_type, src_ptr, src_bytes,
                                                      ffi.cast("uint16_t *", dst_ptr), n_elements,
                                                      ffi.cast("void *", stream_pointer(stream))))

    def dequantize_rows(self, ggml_type, table, n_cols, rows) -> np.ndarray:
        """float32 [len(rows), n_cols]: rows `rows` of the host matrix whose GGUF bytes are `table`, decoded on
        the CPU by either library (pebble_dequantize_rows)."""
        n_cols = _c_int(n_cols, "n_cols", INT64_MIN, INT64_MAX, InvalidArgumentError, "does not fit in int64")
        ids = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        view = host_buffer(table, writable=False, what="dequantize_rows table")
        # No type packs over 2 elements a byte: wider rows are the library's to refuse, before it writes.
        # (an n_cols no row of the table can have is refused by the library before it writes: no room for it)
        out = np.empty((ids.size, n_cols if 0 < n_cols <= _ELEMENTS_PER_BYTE * view.nbytes else 0), dtype=np.float32)
        _check(self._lib, self._lib.pebble_dequantize_rows(
            _c_type(ggml_type), ffi.from_buffer(view), view.nbytes, n_cols, ffi.from_buffer("int64_t[]", ids),
            ids.size, ffi.from_buffer("float[]", out, require_writable=True)))
        return out

    def matvec(self, ggml_type, w, n_rows, n_cols, x, n_vec, out, *, stream=None) -> None:
        """out[v, r] = sum over c of W[r, c] * x[v, c]: W's GGUF bytes in `w`, x n_vec x n_cols fp16,
        out n_vec x n_rows float32."""
        self._matvec("matvec", ggml_type, w, n_rows, n_cols, x, n_vec, out, stream, INT32_MIN, INT32_MAX)

    def matmul(self, ggml_type, w, n_rows, n_cols, x, n_vec, out, *, stream=None) -> None:
        """As matvec for any number of vectors (pebble_matmul)."""
        self._matvec("matmul", ggml_type, w, n_rows, n_cols, x, n_vec, out, stream, INT64_MIN, INT64_MAX)

    def matmul_f32(self, ggml_type, w, n_rows, n_cols, x, n_vec, out, *, stream=None) -> None:
        """As matmul for float32 vectors, each element rounded to fp16 by the library (pebble_matmul_f32)."""
        self._matvec("matmul_f32", ggml_type, w, n_rows, n_cols, x, n_vec, out, stream, INT64_MIN, INT64_MAX)

    def _matvec(self, fn, ggml_type, w, n_rows, n_cols, x, n_vec, out, stream, vec_min, vec_max) -> None:
        ggml_type = _c_type(ggml_type)
        n_rows, n_cols = (_c_int(n, what, INT64_MIN, INT64_MAX, InvalidArgumentError,
                                 "does not fit in int64") for n, what in ((n_rows, "n_rows"), (n_cols, "n_cols")))
        n_vec = _c_int(n_vec, "n_vec", vec_min, vec_max, InvalidArgumentError,
                       f"does not fit in int{32 if vec_max == INT32_MAX else 64}")
        w_ptr, w_bytes = _buffer(w, self.backend, writable=False, what=f"{fn} w")
        x_ptr, x_bytes = _buffer(x, self.backend, writable=False, what=f"{fn} x")
        y_ptr, y_bytes = _buffer(out, self.backend, writable=True, what=f"{fn} out")
        limit = self.MAX_VEC if fn == "matvec" else vec_max
        item, kind = (4, "float32") if fn == "matmul_f32" else (2, "fp16")
        if 1 <= n_vec <= limit and n_rows > 0 and n_cols > 0:  # else the library refuses the call
            if x_bytes != item * n_vec * n_cols:
                raise SizeMismatchError(f"{fn}: x holds {x_bytes} bytes; {n_vec} {kind} vectors of {n_cols} "
                                        f"need {item * n_vec * n_cols}")
            if y_bytes != 4 * n_vec * n_rows:
                raise SizeMismatchError(f"{fn}: out holds {y_bytes} bytes; {n_vec} float32 vectors of "
                                        f"{n_rows} need {4 * n_vec * n_rows}")
        call = {"matvec": self._lib.pebble_matvec, "matmul": self._lib.pebble_matmul,
                "matmul_f32": self._lib.pebble_matmul_f32}[fn]
        _check(self._lib, call(ggml_type, w_ptr, w_bytes, n_rows, n_cols,
                               ffi.cast("float *" if fn == "matmul_f32" else "uint16_t *", x_ptr), n_vec,
                               ffi.cast("float *", y_ptr), ffi.cast("void *", stream_pointer(stream))))

    # -- the decode step of a whole model

    def decoder(self, model, layers, k_caches, v_caches):
        """pebble_decoder_create over a StepModel, its StepLayers and every cache (layer i's of sequence s at
        i * n_seq + s); each buffer's size is checked here against the shapes, since the library cannot
        see it."""
        return NativeDecoder(self, model, layers, k_caches, v_caches)

    # -- attention of a batch of sequences, one query each

    def attend_scratch_bytes(self, n_seq: int, n_head: int, n_rows: int) -> int:
        out = ffi.new("uint64_t *")
        _check(self._lib, self._lib.pebble_attend_scratch_bytes(n_seq, n_head, n_rows, out))
        return int(out[0])

    def attend(self, q, kv_type: int, k_caches, v_caches, n_pos, n_rows: int, n_head: int, n_head_kv: int,
               head_dim: int, scale: float, softcap: float, out, scratch, *, k_new=None, v_new=None,
               stream=None) -> None:
        """pebble_attend: q and out [n_seq, n_head * head_dim] float32, a K and a V cache per sequence
        (each n_rows x n_head_kv x head_dim of kv_type), n_pos rows attended in each; k_new and v_new
        (float32 [n_seq, n_head_kv * head_dim], or None) stored into row n_pos[b] - 1 first."""
        backend, n_seq = self.backend, len(k_caches)
        check_attend_counts(k_caches, v_caches, n_pos)
        q_ptr, q_bytes = _pointer(q, backend, False, "q")
        out_ptr, out_bytes = _pointer(out, backend, True, "out")
        want = 4 * n_seq * n_head * head_dim
        for what, nbytes in (("q", q_bytes), ("out", out_bytes)):
            if nbytes != want:
                raise SizeMismatchError(f"attend: {what} holds {nbytes} bytes; {n_seq} sequences of {n_head} heads "
                                        f"of {head_dim} float32 need {want}")
        new_ptrs = (ffi.NULL, ffi.NULL)
        if (k_new is None) != (v_new is None):
            raise InvalidArgumentError("attend: k_new and v_new go together (both rows, or both None)")
        if k_new is not None:
            new_ptrs = []
            for what, rows in (("k_new", k_new), ("v_new", v_new)):
                ptr, nbytes = _pointer(rows, backend, False, what)
                if nbytes != 4 * n_seq * n_head_kv * head_dim:
                    raise SizeMismatchError(f"attend: {what} holds {nbytes} bytes; {n_seq} rows of {n_head_kv} heads "
                                            f"of {head_dim} float32 need {4 * n_seq * n_head_kv * head_dim}")
                new_ptrs.append(ffi.cast("const float *", ptr))
        k_array, v_array = self._cache_pointers(kv_type, k_caches, v_caches, n_rows * n_head_kv, head_dim)
        scratch_ptr, scratch_bytes = _pointer(scratch, backend, True, "scratch")
        _check(self._lib, self._lib.pebble_attend(
            n_seq, ffi.cast("const float *", q_ptr), new_ptrs[0], new_ptrs[1], kv_type, k_array, v_array,
            ffi.new("int64_t[]", [int(n) for n in n_pos]), n_rows, n_head, n_head_kv, head_dim, scale, softcap,
            ffi.cast("float *", out_ptr), scratch_ptr, scratch_bytes, ffi.cast("void *", stream_pointer(stream))))

    def attend_prompt(self, q, kv_type: int, k_cache, v_cache, pos: int, n_rows: int, n_head: int, n_head_kv: int,
                      head_dim: int, window: int, scale: float, softcap: float, out, *, stream=None,
                      sinks=None) -> None:
        """pebble_attend_prompt: q and out [n_tok, n_head * head_dim] float32, the queries at positions
        pos..pos + n_tok - 1 of one sequence over rows 0..pos + n_tok - 1 of its caches (n_rows x n_head_kv x
        head_dim of kv_type, the chunk's own rows already written)."""
        backend = self.backend
        q_ptr, q_bytes = _pointer(q, backend, False, "q")
        out_ptr, out_bytes = _pointer(out, backend, True, "out")
        width = 4 * n_head * head_dim
        if min(n_head, head_dim) >= 1 and (q_bytes % width or out_bytes != q_bytes or q_bytes == 0):
            raise SizeMismatchError(f"attend_prompt: q holds {q_bytes} bytes and out {out_bytes}; each must be the "
                                    f"same whole number (at least 1) of rows of {n_head} heads of {head_dim} float32")
        n_tok = q_bytes // width if width > 0 else 0
        valid = min(n_rows, n_head_kv, head_dim) >= 1 and n_head % n_head_kv == 0  # else the library's refusal
        want = _kv_bytes(kv_type, n_rows * n_head_kv, head_dim) if valid else None
        pointers = []
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            ptr, nbytes = _pointer(cache, backend, False, name)
            if want is not None and nbytes != want:
                raise SizeMismatchError(f"attend_prompt: the {name} holds {nbytes} bytes; {n_rows} rows of {n_head_kv} "
                                        f"heads of {head_dim} of KV type {kv_type} need {want}")
            pointers.append(ffi.cast("const void *", ptr))
        sinks_ptr = ffi.NULL
        if sinks is not None:  # n_head float32
            sinks_ptr, nbytes = _pointer(sinks, backend, False, "sinks")
            if nbytes != 4 * n_head:
                raise SizeMismatchError(f"attend_prompt: sinks hold {nbytes} bytes; {n_head} float32 are needed")
        _check(self._lib, self._lib.pebble_attend_prompt(
            ffi.cast("const float *", q_ptr), n_tok, pos, kv_type, pointers[0], pointers[1], n_rows, n_head, n_head_kv,
            head_dim, window, scale, softcap, ffi.cast("const float *", sinks_ptr), ffi.cast("float *", out_ptr),
            ffi.cast("void *", stream_pointer(stream))))

    def _cache_pointers(self, kv_type: int, k_caches, v_caches, heads: int, head_dim: int):
        """The two pointer arrays pebble_attend takes for these caches, each cache's size checked. Made
        once per set of caches: a decode step attends every layer of every step over the same arrays.
        An entry holds its arrays by weak reference only, so the caches die with their sequence and
        model; one whose arrays have gone (and whose ids another array may have taken) is made again."""
        cache = self.__dict__.setdefault("_attend_pointers", {})
        key = (kv_type, heads, head_dim, *map(id, k_caches), *map(id, v_caches))
        hit = cache.get(key)
        if hit is not None:
            arrays, refs = hit
            if all(ref() is c for ref, c in zip(refs, (*k_caches, *v_caches))):
                return arrays
            del cache[key]
        cache_bytes = _kv_bytes(kv_type, heads, head_dim)
        arrays = []
        for name, caches in (("k_cache", k_caches), ("v_cache", v_caches)):
            row = []
            for c in caches:
                ptr, nbytes = _pointer(c, self.backend, True, name)  # new rows are written into them
                if cache_bytes is not None and nbytes != cache_bytes:
                    raise SizeMismatchError(f"attend: a {name} holds {nbytes} bytes; {cache_bytes} are needed")
                row.append(ptr)
            arrays.append(ffi.new("void *[]", [ffi.cast("void *", p) for p in row]))
        try:
            refs = [weakref.ref(c) for c in (*k_caches, *v_caches)]
        except TypeError:  # an array type that cannot be weakly referenced: not kept, made at each call
            return arrays[0], arrays[1]
        if len(cache) >= 256:  # batches of other sequences, or a plan made again: start afresh
            cache.clear()
        cache[key] = ((arrays[0], arrays[1]), refs)
        return arrays[0], arrays[1]

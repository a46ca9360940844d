"""Bindings to the native library's quantized-tensor kernels and decode step (the "quantized tensors"
and "decode step" sections of native/pebble.h), over the declarations native.py reads from the header.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..errors import ClosedError, InvalidArgumentError, PebblingError, SizeMismatchError
from ..ggml_types import DENSE_TYPES
from ..kv_types import KV_BY_GGML
from .abi import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN
from .interface import check_attend_counts, stream_pointer
from .kernels import DECODE_WEIGHTS, DECODER_STATS, EXPERT_MATRICES
from .native import _DEVICE_MEMORY, _buffer, _c_int, _check, ffi, load_library


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

    def decoder(self, model, layers, k_caches, v_caches) -> "NativeDecoder":
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
                      head_dim: int, window: int, scale: float, softcap: float, out, *, stream=None) -> None:
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
        _check(self._lib, self._lib.pebble_attend_prompt(
            ffi.cast("const float *", q_ptr), n_tok, pos, kv_type, pointers[0], pointers[1], n_rows, n_head, n_head_kv,
            head_dim, window, scale, softcap, ffi.cast("float *", out_ptr), ffi.cast("void *", stream_pointer(stream))))

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


class NativeDecoder:
    """A pebble_decoder_t and every buffer it names, kept alive with it."""

    def __init__(self, kernels: NativeKernels, model, layers, k_caches, v_caches):
        lib, backend = kernels._lib, kernels.backend
        self._lib, self._backend, self._keep = lib, backend, []
        if len(layers) != model.n_layer or len(k_caches) != model.n_layer * model.n_seq or \
                len(v_caches) != len(k_caches):
            raise SizeMismatchError(f"decoder: {len(layers)} layers and {len(k_caches)} K / {len(v_caches)} V caches; "
                                    f"{model.n_layer} layers of {model.n_seq} sequences need "
                                    f"{model.n_layer * model.n_seq} of each")
        c_layers, checked = ffi.new("struct pebble_step_layer[]", len(layers)), []
        for i, (layer, c) in enumerate(zip(layers, c_layers)):
            shape = layer.shape
            for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "rope_dims", "rope_neox", "rms_eps",
                         "gelu", "ring", "attn_softcap", "residual_scale", "n_expert", "n_expert_used", "n_ff_exp",
                         "n_ff_shexp", "expert_norm", "expert_scale"):
                setattr(c.shape, name, getattr(shape, name))
            # Sizes follow from a shape the library takes; another it refuses by name, with its own message.
            valid = min(shape.n_embd, shape.n_head, shape.n_head_kv, shape.head_dim, shape.n_ff) >= 1 and \
                shape.n_head % shape.n_head_kv == 0
            sizes = decode_buffer_sizes(shape, kernels.type_block) if valid else {}
            checked.append(valid)
            if layer.streamed is not None:  # types here; the entries' sizes are the library's to check
                c.streamed = 1
                ids = dict.fromkeys(DECODE_WEIGHTS, -1) | dict(layer.streamed)
                for f, name in enumerate(DECODE_WEIGHTS):
                    c.weight_ids[f] = _c_int(ids[name], f"layer {i} {name}'s entry", INT32_MIN, INT32_MAX,
                                             InvalidArgumentError, "does not fit in int32")
            if layer.experts is not None:
                ids, cache = layer.experts
                merged = isinstance(ids, tuple)  # the merged tensors' entries (gate, up, down), or expert 0's entry
                c.experts_stored = 2 if merged else 1
                as_int = lambda v, what: _c_int(v, f"layer {i}'s {what}", INT32_MIN, INT32_MAX,  # noqa: E731
                                                InvalidArgumentError, "does not fit in int32")
                c.expert_cache = as_int(cache, "expert_cache")
                if merged:
                    for name, tid in zip(EXPERT_MATRICES, ids, strict=True):
                        c.weight_ids[DECODE_WEIGHTS.index(name)] = as_int(tid, f"{name}'s entry")
                else:
                    c.expert_ids = as_int(ids, "expert_ids")
            for name, (ggml_type, buffer) in layer.weights.items():
                if layer.streamed is not None or buffer is None:
                    getattr(c.weights, name).ggml_type = _c_type(ggml_type)
                    continue
                ptr, nbytes = self._pointer(buffer, False, f"layer {i} {name}")
                want = sizes[name](_c_type(ggml_type)) if name in sizes else None
                if want is not None and nbytes != want:
                    raise SizeMismatchError(f"decoder: layer {i}: {name} holds {nbytes} bytes; GGUF type {ggml_type} "
                                            f"needs {want} for this shape")
                field = getattr(c.weights, name)
                field.ggml_type, field.data = _c_type(ggml_type), ptr
            for what, table in (("rope_cos", layer.rope_cos), ("rope_sin", layer.rope_sin)):
                ptr, nbytes = self._pointer(table, False, f"layer {i} {what}")
                if nbytes % (4 * shape.head_dim) or nbytes == 0:
                    raise SizeMismatchError(f"decoder: layer {i}: {what} holds {nbytes} bytes; whole rows of "
                                            f"{shape.head_dim} float32 are needed")
                setattr(c, what, ffi.cast("const float *", ptr))
                c.rope_rows = nbytes // (4 * shape.head_dim)
            c.kv_rows, c.attn_scale = layer.kv_rows, layer.attn_scale
        caches = []
        for name, arrays in (("k_cache", k_caches), ("v_cache", v_caches)):
            pointers = []
            for n, cache in enumerate(arrays):
                i = n // model.n_seq
                if layers[i].streamed is not None:  # in a slot of the decoder's
                    pointers.append(ffi.NULL)
                    continue
                ptr, nbytes = self._pointer(cache, True, f"layer {i} {name}")
                want = None if not checked[i] else \
                    _kv_bytes(model.kv_type, layers[i].kv_rows * layers[i].shape.n_head_kv, layers[i].shape.head_dim)
                if want is not None and nbytes != want:
                    raise SizeMismatchError(f"decoder: layer {i}: a {name} holds {nbytes} bytes; {want} are needed")
                pointers.append(ffi.cast("void *", ptr))
            caches.append(ffi.new("void *[]", pointers))
        c_model = ffi.new("struct pebble_step_model *")
        for name in ("n_layer", "n_embd", "n_vocab", "n_seq", "kv_type", "rms_eps", "logit_scale", "final_softcap"):
            setattr(c_model, name, getattr(model, name))
        c_model.graphs = 1 if model.graphs else 0
        c_model.expert_policy, c_model.expert_prefetch = model.expert_policy, int(model.expert_prefetch)
        if any(layer.experts is not None for layer in layers):
            for name, store in (("store", model.store), ("expert_store", model.expert_store)):
                if store is not None:
                    setattr(c_model, name, store._live())
                    self._keep.append(store)
        if any(layer.streamed is not None for layer in layers):
            if model.store is None or len(model.kv_ids) != model.n_seq:
                raise InvalidArgumentError(f"decoder: streamed layers need the store and the (K, V) entries of each "
                                           f"of {model.n_seq} sequences; got {len(model.kv_ids)}")
            c_model.store = model.store._live()
            kv_ids = ffi.new("int32_t[]", [_c_int(t, "a KV entry", INT32_MIN, INT32_MAX, InvalidArgumentError,
                                                  "does not fit in int32") for pair in model.kv_ids for t in pair])
            c_model.kv_ids = kv_ids
            self._keep += [kv_ids, model.store]
            for k, slot in enumerate(model.slots[:2]):
                ptr, nbytes = self._pointer(slot, True, f"slot {k}")
                c_model.slots[k] = ffi.cast("void *", ptr)
                c_model.slot_bytes = nbytes if k == 0 else min(c_model.slot_bytes, nbytes)
        norm_type, norm = model.output_norm
        ptr, nbytes = self._pointer(norm, False, "output_norm")
        if norm_type in _ITEMSIZE and nbytes != model.n_embd * _ITEMSIZE[norm_type]:
            raise SizeMismatchError(f"decoder: output_norm holds {nbytes} bytes; {model.n_embd} elements are needed")
        c_model.output_norm.ggml_type, c_model.output_norm.data = _c_type(norm_type), ptr
        out_type, output = model.output
        ptr, nbytes = self._pointer(output, False, "output")
        try:
            elements, block_bytes = kernels.type_block(out_type)
        except PebblingError:
            elements = block_bytes = None  # the library refuses the type, with its own message
        if elements and model.n_embd % elements == 0 and nbytes != model.n_vocab * model.n_embd // elements * block_bytes:
            raise SizeMismatchError(f"decoder: output holds {nbytes} bytes; {model.n_vocab} rows of {model.n_embd} "
                                    f"of GGUF type {out_type} need {model.n_vocab * model.n_embd // elements * block_bytes}")
        c_model.output.ggml_type, c_model.output.data = _c_type(out_type), ptr
        handle = ffi.new("pebble_decoder_t *")
        _check(lib, lib.pebble_decoder_create(c_model, c_layers, caches[0], caches[1], handle))
        self._handle = ffi.gc(handle[0], lib.pebble_decoder_free)
        self._keep += [c_layers, caches, c_model, layers, list(k_caches), list(v_caches), model]
        self._stats = ffi.new("struct pebble_decoder_stats *")

    def _pointer(self, obj, writable: bool, name: str):
        ptr, nbytes = _pointer(obj, self._backend, writable, name)
        self._keep.append(obj)
        return ptr, nbytes

    def step(self, seqs, positions, x, logits, *, stream=None) -> None:
        if self._handle is None:
            raise ClosedError("pebble_decoder_step: the decoder was freed or never made")
        n = len(seqs)
        if len(positions) != n:
            raise SizeMismatchError(f"decoder step: {n} sequences but {len(positions)} positions")
        x_ptr, x_bytes = _pointer(x, self._backend, True, "x")
        model = self._keep[-1]
        if 1 <= n <= model.n_seq and x_bytes != 4 * n * model.n_embd:  # another count: the library's refusal
            raise SizeMismatchError(f"decoder step: x holds {x_bytes} bytes; {n} float32 rows of {model.n_embd} "
                                    f"need {4 * n * model.n_embd}")
        out_ptr = ffi.NULL
        if logits is not None:
            out_ptr, out_bytes = _pointer(logits, self._backend, True, "logits")
            if out_bytes != 4 * n * model.n_vocab:
                raise SizeMismatchError(f"decoder step: logits hold {out_bytes} bytes; {n} float32 rows of "
                                        f"{model.n_vocab} need {4 * n * model.n_vocab}")
        _check(self._lib, self._lib.pebble_decoder_step(
            self._handle, n, ffi.new("int32_t[]", [int(s) for s in seqs]),
            ffi.new("int64_t[]", [int(p) for p in positions]), ffi.cast("float *", x_ptr),
            ffi.cast("float *", out_ptr), ffi.cast("void *", stream_pointer(stream))))

    def stats(self) -> dict:
        if self._handle is None:
            raise ClosedError("pebble_decoder_stats: the decoder was freed or never made")
        _check(self._lib, self._lib.pebble_decoder_stats(self._handle, self._stats))
        return {name: int(getattr(self._stats, name)) for name in DECODER_STATS}

    def close(self) -> None:
        """Frees the decoder now (the buffers it named are the caller's)."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            ffi.release(handle)  # runs its destructor, pebble_decoder_free, now
        self._keep = []


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


def decode_buffer_sizes(shape, type_block) -> dict:
    """For each weight of a layer, a function of its GGUF type giving the bytes its buffer must hold."""
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    e, ff = shape.n_embd, shape.n_ff
    E, fx, sh = shape.n_expert, shape.n_ff_exp, shape.n_ff_shexp

    def matrix(rows, cols):
        def size(ggml_type):
            try:
                elements, nbytes = type_block(ggml_type)
            except PebblingError:
                return None
            return rows * (cols // elements) * nbytes if cols % elements == 0 else None
        return size

    def vector(n):
        return lambda ggml_type: n * _ITEMSIZE[ggml_type] if ggml_type in _ITEMSIZE else None

    return {"attn_norm": vector(e), "wq": matrix(q, e), "wk": matrix(kv, e), "wv": matrix(kv, e),
            "wo": matrix(e, q), "ffn_norm": vector(e), "w_gate": matrix(ff, e), "w_up": matrix(ff, e),
            "w_down": matrix(e, ff), "bq": vector(q), "bk": vector(kv), "bv": vector(kv),
            "q_norm": vector(shape.head_dim), "k_norm": vector(shape.head_dim), "post_attn_norm": vector(e),
            "post_ffn_norm": vector(e), "ffn_gate_inp": matrix(E, e), "ffn_gate_exps": matrix(E * fx, e),
            "ffn_up_exps": matrix(E * fx, e), "ffn_down_exps": matrix(E * e, fx), "ffn_gate_inp_shexp": vector(e),
            "ffn_gate_shexp": matrix(sh, e), "ffn_up_shexp": matrix(sh, e), "ffn_down_shexp": matrix(e, sh)}


def _c_type(ggml_type) -> int:
    """A GGUF type id (an int or gguf's GGMLQuantizationType); whether it has kernels is the library's
    to judge."""
    return _c_int(ggml_type, "ggml type", INT32_MIN, INT32_MAX, InvalidArgumentError, "does not fit in int32")

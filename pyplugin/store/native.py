"""Bindings to the native library (native/pebble.h) through cffi in ABI mode: no compiler needed at install.

The only module that touches cffi. The declarations are read from pebble.h itself (shipped beside
this module), so the header is the one source of the ABI: no struct layout or constant is typed
again here. `NativeStore` wraps one pebble_store_t handle; `NativeKernels` the library's
quantized-tensor kernels. `_check` turns every status code into a PebbleError subclass carrying the
library's own message.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import numpy as np
from cffi import FFI

from ..errors import (
    InvalidArgumentError, LayerRangeError, PebblingError, SizeMismatchError, StrategyError, error_for,
)
from ..ggml_types import DENSE_TYPES
from .abi import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, MAX_DIMS, TIER_AUTO, UINT64_MAX
from .interface import (
    EntryInfo, StoreStats, STATS_FIELDS, Store, as_int, as_strategy, check_view, default_desc, host_buffer,
    stream_pointer, tier_code,
)

HEADER = Path(__file__).resolve().with_name("pebble.h")


def declarations(header: str) -> str:
    """pebble.h as cffi's cdef takes it: comments, the include guard, the export macro and the C++
    guard dropped; integer #defines kept, so that the library's constants are read from there too."""
    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            define = re.fullmatch(r"#\s*define\s+(PEBBLE_\w+)\s+\(?(-?\d+)\)?", stripped)
            if define:
                lines.append(f"#define {define.group(1)} {define.group(2)}")
            continue
        if stripped in ('extern "C" {', "}"):  # the C++ guard's braces (#ifdef __cplusplus)
            continue
        lines.append(line.replace("PEBBLE_API ", ""))
    return "\n".join(lines)


ffi = FFI()
ffi.cdef(declarations(HEADER.read_text()))

KINDS = ("cuda", "host")
_DEVICE_MEMORY = {"cuda": True, "host": False}  # whether the library's buffers may be CUDA arrays
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # pyplugin/
_BUILD_DIR = _PACKAGE_DIR.parent / "build"
_loaded: dict[tuple[str, str | None], tuple[object, str]] = {}
_load_lock = threading.Lock()


def library_candidates(kind: str) -> list[Path]:
    """Where the `kind` library is looked for, in order."""
    # 1. $PEBBLING_LIB names one library explicitly (a sanitizer build, say); when set it is the only
    #    candidate, so a test run never silently falls back to another build.
    override = os.environ.get("PEBBLING_LIB")
    if override:
        return [Path(override)]
    name = f"libpebble_{kind}.so"
    return [
        _PACKAGE_DIR / name,  # 2. the package's own directory, where an installed wheel carries it
        _BUILD_DIR / name,    # 3. the repository's build/ directory, where `make cuda|host` puts it
    ]


def load_library(kind: str):
    """Loads the `kind` ("cuda" or "host") library: returns (lib, path), or raises OSError saying
    what was tried and why each failed."""
    if kind not in KINDS:
        raise PebblingError(f"unknown native library kind {kind!r}; valid: {', '.join(KINDS)}")
    cache_key = (kind, os.environ.get("PEBBLING_LIB"))
    with _load_lock:
        if cache_key in _loaded:
            return _loaded[cache_key]
        failures = []
        for path in library_candidates(kind):
            if not path.is_file():
                failures.append(f"{path}: no such file")
                continue
            try:
                lib = ffi.dlopen(str(path))
                built_as = ffi.string(lib.pebble_backend()).decode()
            except (OSError, AttributeError) as exc:  # AttributeError: a symbol is missing
                failures.append(f"{path}: {exc}")
                continue
            if built_as != kind:
                failures.append(f"{path}: built as {built_as!r}, not {kind!r}")
                continue
            _loaded[cache_key] = (lib, str(path))
            return _loaded[cache_key]
        raise OSError(f"no usable {kind} pebble library: " + "; ".join(failures))



def _check(lib, status: int) -> None:
    """The one place a status code becomes an exception, with the calling thread's native message."""
    if status != 0:
        raise error_for(status, ffi.string(lib.pebble_last_error()).decode("utf-8", "replace"))


def _buffer(obj, backend: str, *, writable: bool, what: str):
    """(pointer, nbytes) of a host buffer or, on the cuda backend, of a CUDA array."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        view = host_buffer(obj, writable=writable, what=what)
        return ffi.from_buffer("char[]", view, require_writable=writable), view.nbytes
    if not _DEVICE_MEMORY[backend]:
        raise InvalidArgumentError(f"{what} is device memory ({type(obj).__name__}); the "
                                   f"{backend} backend holds host memory only")
    itemsize = np.dtype(cai["typestr"]).itemsize
    shape = tuple(cai["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    strides = cai.get("strides")
    if strides is not None and nbytes and tuple(strides) != _c_strides(shape, itemsize):
        raise InvalidArgumentError(f"{what} must be C-contiguous (shape {shape}, strides {strides})")
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise InvalidArgumentError(f"{what} must be writable, got a read-only CUDA array")
    return ffi.cast("void *", ptr), nbytes


def _c_int(value, what: str, lo: int, hi: int, error, problem: str) -> int:
    """`value` as an integer within [lo, hi] (its C parameter's range), else error(what value problem)."""
    value = as_int(value, what)
    if not lo <= value <= hi:
        raise error(f"{what} {value} {problem}")
    return value


class NativeStore(Store):
    """A store in the native library `kind`; see pyplugin.store.interface.Store for the semantics."""

    def __init__(self, device_limit: int, n_layers: int, strategy, *, device: int = 0,
                 kind: str = "host"):
        self._lib, self.library_path = load_library(kind)
        self.backend = kind
        self.strategy = as_strategy(strategy)
        self.device_limit = _c_int(device_limit, "device limit", 0, UINT64_MAX, InvalidArgumentError,
                                   "bytes is outside [0, 2**64)")
        self.n_layers = _c_int(n_layers, "n_layers", INT32_MIN, INT32_MAX, InvalidArgumentError,
                               "does not fit in int32")
        device = _c_int(device, "device index", 0, INT32_MAX, InvalidArgumentError, "is not >= 0")
        self._close_lock = threading.Lock()
        self._handle = None
        out = ffi.new("pebble_store_t *")
        self._check(self._lib.pebble_init(self.device_limit, self.n_layers, *_c_strategy(self.strategy),
                                          device, out))
        self._handle = out[0]

    def _check(self, status: int) -> None:
        _check(self._lib, status)

    # -- conversions from Python arguments to C ones

    def _live(self):
        handle = self._handle
        if handle is None:
            raise self._closed_error()
        return handle

    def _layer(self, layer) -> int:
        return _c_int(layer, "layer", INT32_MIN, INT32_MAX, LayerRangeError,
                      f"out of range [0, {self.n_layers})")

    @staticmethod
    def _tensor_id(tensor_id) -> int:
        return _c_int(tensor_id, "tensor id", INT32_MIN, INT32_MAX, InvalidArgumentError,
                      "does not fit in int32")

    @staticmethod
    def _offset(offset) -> int:
        return _c_int(offset, "offset", 0, UINT64_MAX, InvalidArgumentError, "is outside [0, 2**64)")

    @staticmethod
    def _stream(stream):
        return ffi.cast("void *", stream_pointer(stream))

    def _buffer(self, obj, *, writable: bool, what: str):
        return _buffer(obj, self.backend, writable=writable, what=what)

    def _finish(self, stream) -> None:
        """A call without a stream is done with the caller's buffers when it returns."""
        if stream is None:
            self._check(self._lib.pebble_synchronize(self._live()))

    # -- the calls

    def save(self, layer, tensor_id, data, *, desc=None, tier=TIER_AUTO, stream=None):
        handle = self._live()
        layer, tensor_id, tier = self._layer(layer), self._tensor_id(tensor_id), tier_code(tier)
        src, nbytes = self._buffer(data, writable=False, what="save data")
        desc = default_desc(data, desc)
        c_desc = ffi.NULL
        if desc is not None:
            shape = tuple(desc.shape)
            if len(shape) > MAX_DIMS:
                raise InvalidArgumentError(f"save: layer {layer} tensor {tensor_id}: shape {shape} has "
                                           f"more than {MAX_DIMS} dimensions")
            c_desc = ffi.new("struct pebble_tensor_desc *")
            c_desc.ggml_type = _c_int(desc.ggml_type, "ggml type", INT32_MIN, INT32_MAX,
                                      InvalidArgumentError, "does not fit in int32")
            c_desc.n_dims = len(shape)
            c_desc.ne[0:len(shape)] = [_c_int(n, "dimension", INT64_MIN, INT64_MAX,
                                              InvalidArgumentError, "does not fit in int64") for n in shape]
        tier = _c_int(tier, "tier", INT32_MIN, INT32_MAX, InvalidArgumentError, "is not a tier")
        self._check(self._lib.pebble_save(handle, layer, tensor_id, src, nbytes, c_desc, tier,
                                          self._stream(stream)))
        self._finish(stream)

    def restore(self, layer, tensor_id, out, *, stream=None):
        handle = self._live()
        layer, tensor_id = self._layer(layer), self._tensor_id(tensor_id)
        dst, nbytes = self._buffer(out, writable=True, what="restore out")
        self._check(self._lib.pebble_restore(handle, layer, tensor_id, dst, nbytes, self._stream(stream)))
        self._finish(stream)

    def read(self, layer, tensor_id, offset, out, *, stream=None):
        handle = self._live()
        layer, tensor_id, offset = self._layer(layer), self._tensor_id(tensor_id), self._offset(offset)
        dst, nbytes = self._buffer(out, writable=True, what="read out")
        self._check(self._lib.pebble_read(handle, layer, tensor_id, offset, dst, nbytes,
                                          self._stream(stream)))
        self._finish(stream)

    def write(self, layer, tensor_id, offset, data, *, stream=None):
        handle = self._live()
        layer, tensor_id, offset = self._layer(layer), self._tensor_id(tensor_id), self._offset(offset)
        src, nbytes = self._buffer(data, writable=False, what="write data")
        self._check(self._lib.pebble_write(handle, layer, tensor_id, offset, src, nbytes,
                                           self._stream(stream)))
        self._finish(stream)

    def erase(self, layer, tensor_id):
        handle = self._live()
        self._check(self._lib.pebble_erase(handle, self._layer(layer), self._tensor_id(tensor_id)))

    def prefetch(self, layer, *, stream=None):
        handle = self._live()
        self._check(self._lib.pebble_prefetch(handle, self._layer(layer), self._stream(stream)))
        self._finish(stream)

    def entry_info(self, layer, tensor_id) -> EntryInfo:
        handle = self._live()
        out = ffi.new("struct pebble_entry_info *")
        self._check(self._lib.pebble_entry_info(handle, self._layer(layer), self._tensor_id(tensor_id), out))
        n_dims = max(0, min(out.desc.n_dims, MAX_DIMS))
        return EntryInfo(int(out.nbytes), int(out.desc.ggml_type), tuple(out.desc.ne[0:n_dims]),
                         bool(out.on_device), bool(out.on_host))

    def device_pointer(self, layer, tensor_id) -> int:
        """Address of the entry's device copy, to compute from it in place (cuda backend); valid until
        the entry is evicted, replaced or erased. UnknownEntryError when it has no device copy."""
        handle = self._live()
        out = ffi.new("void **")
        self._check(self._lib.pebble_device_pointer(handle, self._layer(layer), self._tensor_id(tensor_id),
                                                    out))
        return int(ffi.cast("uintptr_t", out[0]))

    def device_array(self, layer, tensor_id, dtype, shape):
        ptr = self.device_pointer(layer, tensor_id)
        nbytes = self.entry_info(layer, tensor_id).nbytes
        dtype, shape = check_view("device_array", layer, tensor_id, nbytes, dtype, shape)
        if not _DEVICE_MEMORY[self.backend]:  # the host build's device tier is host memory
            return np.frombuffer(ffi.buffer(ffi.cast("char *", ptr), nbytes), dtype).reshape(shape)
        import cupy

        memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner=self)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    def set_strategy(self, strategy, *, device_limit=None) -> None:
        handle = self._live()
        strategy = as_strategy(strategy)
        limit = self.device_limit if device_limit is None else _c_int(
            device_limit, "device limit", 0, UINT64_MAX, InvalidArgumentError, "bytes is outside [0, 2**64)")
        self._check(self._lib.pebble_set_strategy(handle, limit, *_c_strategy(strategy)))
        self.strategy, self.device_limit = strategy, limit

    def should_checkpoint(self, layer) -> bool:
        handle = self._live()
        out = ffi.new("int32_t *")
        self._check(self._lib.pebble_should_checkpoint(handle, self._layer(layer), out))
        return bool(out[0])

    def stats(self) -> StoreStats:
        handle = self._live()
        out = ffi.new("struct pebble_stats *")
        self._check(self._lib.pebble_stats(handle, out))
        return StoreStats(**{name: int(getattr(out, name)) for name in STATS_FIELDS})

    def reset_stats(self) -> None:
        self._check(self._lib.pebble_stats_reset(self._live()))

    def synchronize(self) -> None:
        self._check(self._lib.pebble_synchronize(self._live()))

    def close(self) -> None:
        with self._close_lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._check(self._lib.pebble_free(handle))

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __del__(self):
        # A store dropped without close() still gives its memory back; never raise from a finalizer.
        try:
            self.close()
        except Exception:
            pass


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
        ggml_type = _c_type(ggml_type)
        n_rows, n_cols = (_c_int(n, what, INT64_MIN, INT64_MAX, InvalidArgumentError,
                                 "does not fit in int64") for n, what in ((n_rows, "n_rows"), (n_cols, "n_cols")))
        n_vec = _c_int(n_vec, "n_vec", INT32_MIN, INT32_MAX, InvalidArgumentError, "does not fit in int32")
        w_ptr, w_bytes = _buffer(w, self.backend, writable=False, what="matvec w")
        x_ptr, x_bytes = _buffer(x, self.backend, writable=False, what="matvec x")
        y_ptr, y_bytes = _buffer(out, self.backend, writable=True, what="matvec out")
        if 1 <= n_vec <= self.MAX_VEC and n_rows > 0 and n_cols > 0:  # else the library refuses the call
            if x_bytes != 2 * n_vec * n_cols:
                raise SizeMismatchError(f"matvec: x holds {x_bytes} bytes; {n_vec} fp16 vectors of {n_cols} "
                                        f"need {2 * n_vec * n_cols}")
            if y_bytes != 4 * n_vec * n_rows:
                raise SizeMismatchError(f"matvec: out holds {y_bytes} bytes; {n_vec} float32 vectors of "
                                        f"{n_rows} need {4 * n_vec * n_rows}")
        _check(self._lib, self._lib.pebble_matvec(ggml_type, w_ptr, w_bytes, n_rows, n_cols,
                                                  ffi.cast("uint16_t *", x_ptr), n_vec,
                                                  ffi.cast("float *", y_ptr),
                                                  ffi.cast("void *", stream_pointer(stream))))


    # -- the decode step

    def decode_scratch_bytes(self, shape, n_ctx: int) -> int:
        """Bytes of scratch `decode_layer` needs (shape: a pyplugin.store.kernels.LayerShape)."""
        out = ffi.new("uint64_t *")
        _check(self._lib, self._lib.pebble_decode_scratch_bytes(self._decode_plan(shape)[0], n_ctx, out))
        return int(out[0])

    def _decode_plan(self, shape):
        """(struct pebble_layer_shape, {(field, ggml_type): bytes its buffer must hold or None}), made once
        per shape: a decode step runs every layer of every token through here."""
        plans = self.__dict__.setdefault("_decode_plans", {})
        plan = plans.get(shape)
        if plan is None:
            c = ffi.new("struct pebble_layer_shape *")
            for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "rope_dims", "rope_neox", "rms_eps"):
                setattr(c, name, getattr(shape, name))
            plan = plans[shape] = (c, decode_buffer_sizes(shape, self.type_block), {})
        return plan

    def decode_layer(self, shape, weights: dict, kv_type: int, k_cache, v_cache, n_ctx: int, pos: int,
                     rope_cos, rope_sin, attn_scale: float, x, scratch, *, stream=None) -> None:
        """One layer for one token (pebble_decode_layer). `weights` maps pebble_layer_weights fields to
        (ggml_type, buffer), absent biases left out; every buffer's size is checked here against the
        shape, since the library cannot see it."""
        c_shape, sizes, wanted = self._decode_plan(shape)
        fields = {}
        backend = self.backend
        for name, (ggml_type, buffer) in weights.items():
            ptr, nbytes = _pointer(buffer, backend, False, name)
            key = (name, ggml_type)
            if key not in wanted:  # None: a type the library refuses, with its own message
                wanted[key] = sizes[name](_c_type(ggml_type)) if name in sizes else None
            want = wanted[key]
            if want is not None and nbytes != want:
                raise SizeMismatchError(f"decode_layer: {name} holds {nbytes} bytes; GGUF type {ggml_type} "
                                        f"needs {want} for this shape")
            fields[name] = (ggml_type, ptr)
        c_weights = ffi.new("struct pebble_layer_weights *", fields)
        kv_item = _ITEMSIZE.get(kv_type)
        cache_bytes = None if kv_item is None else n_ctx * shape.n_head_kv * shape.head_dim * kv_item
        k_ptr, k_bytes = _pointer(k_cache, backend, True, "k_cache")
        v_ptr, v_bytes = _pointer(v_cache, backend, True, "v_cache")
        cos_ptr, cos_bytes = _pointer(rope_cos, backend, False, "rope_cos")
        sin_ptr, sin_bytes = _pointer(rope_sin, backend, False, "rope_sin")
        x_ptr, x_bytes = _pointer(x, backend, True, "x")
        for what, nbytes, want in (("k_cache", k_bytes, cache_bytes), ("v_cache", v_bytes, cache_bytes),
                                   ("rope_cos", cos_bytes, 4 * shape.head_dim),
                                   ("rope_sin", sin_bytes, 4 * shape.head_dim), ("x", x_bytes, 4 * shape.n_embd)):
            if want is not None and nbytes != want:
                raise SizeMismatchError(f"decode_layer: {what} holds {nbytes} bytes; {want} are needed")
        scratch_ptr, scratch_bytes = _pointer(scratch, backend, True, "scratch")
        _check(self._lib, self._lib.pebble_decode_layer(
            c_shape, c_weights, kv_type, k_ptr, v_ptr, n_ctx, pos, ffi.cast("const float *", cos_ptr),
            ffi.cast("const float *", sin_ptr), attn_scale, ffi.cast("float *", x_ptr), scratch_ptr, scratch_bytes,
            ffi.cast("void *", stream_pointer(stream))))


def _pointer(obj, backend: str, writable: bool, name: str):
    """`_buffer` for the decode step's buffers, with fast paths for C-contiguous numpy arrays (host) and
    CuPy arrays (cuda)."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous and (obj.flags.writeable or not writable):
        return ffi.from_buffer(obj, require_writable=writable), obj.nbytes
    if _DEVICE_MEMORY[backend] and type(obj).__module__.startswith("cupy") and obj.flags.c_contiguous:
        return ffi.cast("void *", obj.data.ptr), obj.nbytes
    return _buffer(obj, backend, writable=writable, what=f"decode_layer {name}")


_ITEMSIZE = {ggml_type: dtype.itemsize for dtype, ggml_type in DENSE_TYPES.items()}  # F32 4, F16 2


def decode_buffer_sizes(shape, type_block) -> dict:
    """For each weight of a layer, a function of its GGUF type giving the bytes its buffer must hold."""
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    e, ff = shape.n_embd, shape.n_ff

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
            "w_down": matrix(e, ff), "bq": vector(q), "bk": vector(kv), "bv": vector(kv)}


def _c_type(ggml_type) -> int:
    """A GGUF type id (an int or gguf's GGMLQuantizationType); whether it has kernels is the library's
    to judge."""
    return _c_int(ggml_type, "ggml type", INT32_MIN, INT32_MAX, InvalidArgumentError, "does not fit in int32")


def _c_strategy(strategy) -> tuple[int, int]:
    """(code, arg) as pebble_init takes them; their validity is the library's to judge."""
    return (_c_int(strategy.code, "strategy code", INT32_MIN, INT32_MAX, StrategyError, "is not a strategy"),
            _c_int(strategy.arg, "strategy argument", INT64_MIN, INT64_MAX, StrategyError,
                   "does not fit in int64"))


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))

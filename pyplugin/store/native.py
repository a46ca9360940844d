"""Bindings to the native library (native/pebble.h) through cffi in ABI mode: no compiler needed at install.

With native_kernels.py, the only modules that touch cffi. The declarations are read from pebble.h
itself (shipped beside this module), so the header is the one source of the ABI: no struct layout or
constant is typed again here. `NativeStore` wraps one pebble_store_t handle (the library's
quantized-tensor kernels are in native_kernels.py). `_check` turns every status code into a
PebbleError subclass carrying the library's own message.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import numpy as np
from cffi import FFI

from ..errors import (
    InvalidArgumentError, LayerRangeError, PebblingError, StrategyError, error_for,
)
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
        _PACKAGE_DIR / name,  # 2. the package's own directory, where pip's build (CMakeLists.txt) installs it
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
    if type(obj) is np.ndarray and obj.flags.c_contiguous and obj.dtype.kind in "biuf" and \
            (obj.flags.writeable or not writable):  # the common case, without building a memoryview
        return ffi.from_buffer("char[]", obj, require_writable=writable), obj.nbytes
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
        self._borrowed: list = []  # what pebble_save_borrowed kept: alive as long as this store
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

    @staticmethod
    def _c_desc(layer: int, tensor_id: int, data, desc):
        """struct pebble_tensor_desc of what is saved (NULL: plain bytes)."""
        desc = default_desc(data, desc)
        if desc is None:
            return ffi.NULL
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
        return c_desc

    def save(self, layer, tensor_id, data, *, desc=None, tier=TIER_AUTO, stream=None):
        handle = self._live()
        layer, tensor_id, tier = self._layer(layer), self._tensor_id(tensor_id), tier_code(tier)
        src, nbytes = self._buffer(data, writable=False, what="save data")
        c_desc = self._c_desc(layer, tensor_id, data, desc)
        tier = _c_int(tier, "tier", INT32_MIN, INT32_MAX, InvalidArgumentError, "is not a tier")
        self._check(self._lib.pebble_save(handle, layer, tensor_id, src, nbytes, c_desc, tier,
                                          self._stream(stream)))
        self._finish(stream)

    def save_borrowed(self, layer, tensor_id, data, *, desc=None) -> bool:
        handle = self._live()
        layer, tensor_id = self._layer(layer), self._tensor_id(tensor_id)
        src, nbytes = self._buffer(data, writable=False, what="save data")
        kept = ffi.new("int32_t *")
        self._check(self._lib.pebble_save_borrowed(handle, layer, tensor_id, src, nbytes,
                                                   self._c_desc(layer, tensor_id, data, desc), kept))
        if kept[0]:
            self._borrowed.append(data)
        return bool(kept[0])

    def restore(self, layer, tensor_id, out, *, stream=None):
        handle = self._live()
        layer, tensor_id = self._layer(layer), self._tensor_id(tensor_id)
        dst, nbytes = self._buffer(out, writable=True, what="restore out")
        self._check(self._lib.pebble_restore(handle, layer, tensor_id, dst, nbytes, self._stream(stream)))
        self._finish(stream)

    def read(self, layer, tensor_id, offset, out, *, stream=None):
        self._range_call(self._lib.pebble_read, layer, tensor_id, offset, out, stream, writable=True,
                         what="read out")

    def write(self, layer, tensor_id, offset, data, *, stream=None):
        self._range_call(self._lib.pebble_write, layer, tensor_id, offset, data, stream, writable=False,
                         what="write data")

    def _range_call(self, call, layer, tensor_id, offset, buffer, stream, *, writable: bool, what: str) -> None:
        """pebble_read or pebble_write: bytes [offset, offset + the buffer's size) of an entry. A batched
        decode step reads and writes each sequence's KV rows this way, so plain ints skip the checks that
        other values need."""
        handle = self._live()
        if not (type(layer) is int and type(tensor_id) is int and type(offset) is int
                and INT32_MIN <= layer <= INT32_MAX and INT32_MIN <= tensor_id <= INT32_MAX
                and 0 <= offset <= UINT64_MAX):
            layer, tensor_id, offset = self._layer(layer), self._tensor_id(tensor_id), self._offset(offset)
        ptr, nbytes = self._buffer(buffer, writable=writable, what=what)
        status = call(handle, layer, tensor_id, offset, ptr, nbytes,
                      ffi.NULL if stream is None else self._stream(stream))
        if status:
            self._check(status)
        if stream is None:
            self._check(self._lib.pebble_synchronize(handle))

    def erase(self, layer, tensor_id):
        handle = self._live()
        self._check(self._lib.pebble_erase(handle, self._layer(layer), self._tensor_id(tensor_id)))

    def prefetch(self, layer, *, stream=None):
        handle = self._live()
        self._check(self._lib.pebble_prefetch(handle, self._layer(layer), self._stream(stream)))
        self._finish(stream)

    def keep_on_host(self, layer, tensor_id, keep=True):
        handle = self._live()
        self._check(self._lib.pebble_keep_on_host(handle, self._layer(layer), self._tensor_id(tensor_id),
                                                  1 if keep else 0))

    def entry_info(self, layer, tensor_id) -> EntryInfo:
        handle = self._live()
        out = ffi.new("struct pebble_entry_info *")
        self._check(self._lib.pebble_entry_info(handle, self._layer(layer), self._tensor_id(tensor_id), out))
        n_dims = max(0, min(out.desc.n_dims, MAX_DIMS))
        return EntryInfo(int(out.nbytes), int(out.desc.ggml_type), tuple(out.desc.ne[0:n_dims]),
                         bool(out.on_device), bool(out.on_host))

    def device_pointer(self, layer, tensor_id) -> int:
        """Address of the entry's device copy, to compute from it in place (cuda backend), borrowed:
        valid until the entry is evicted, replaced or erased or the store closed (device_array's views
        hold a lease instead). UnknownEntryError when it has no device copy."""
        handle = self._live()
        out = ffi.new("void **")
        self._check(self._lib.pebble_device_pointer(handle, self._layer(layer), self._tensor_id(tensor_id),
                                                    out))
        return int(ffi.cast("uintptr_t", out[0]))

    def device_array(self, layer, tensor_id, dtype, shape):
        handle = self._live()
        layer, tensor_id = self._layer(layer), self._tensor_id(tensor_id)
        out, size = ffi.new("void **"), ffi.new("uint64_t *")
        self._check(self._lib.pebble_device_acquire(handle, layer, tensor_id, out, size))
        # The array holds the lease (through the buffer or CuPy's owner), so the memory it views lives
        # as long as it does, past an eviction, erase or close; dropping the last reference releases it.
        leased = ffi.gc(ffi.cast("char *", out[0]), self._lib.pebble_device_release)
        nbytes = int(size[0])
        dtype, shape = check_view("device_array", layer, tensor_id, nbytes, dtype, shape)
        if not _DEVICE_MEMORY[self.backend]:  # the host build's device tier is host memory
            return np.frombuffer(ffi.buffer(leased, nbytes), dtype).reshape(shape)
        import cupy

        memory = cupy.cuda.UnownedMemory(int(ffi.cast("uintptr_t", leased)), nbytes, owner=leased)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    def host_array(self, layer, tensor_id, dtype, shape):
        handle = self._live()
        layer, tensor_id = self._layer(layer), self._tensor_id(tensor_id)
        out, size = ffi.new("void **"), ffi.new("uint64_t *")
        self._check(self._lib.pebble_host_acquire(handle, layer, tensor_id, out, size))
        leased = ffi.gc(ffi.cast("char *", out[0]), self._lib.pebble_device_release)  # as device_array's
        nbytes = int(size[0])
        dtype, shape = check_view("host_array", layer, tensor_id, nbytes, dtype, shape)
        return np.frombuffer(ffi.buffer(leased, nbytes), dtype).reshape(shape)

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

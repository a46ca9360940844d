"""The store's interface, shared by every backend (native cuda/host library, pure-Python stub).

Semantics are those of native/pebble.h; this module only gives them Python types. Everything else in
pyplugin talks to a `Store` opened by a backend object (`pyplugin.store.backend`) and never asks which
backend it is talking to.

Buffers: `data` (save, write) is a C-contiguous numpy array or any C-contiguous buffer (bytes,
bytearray, memoryview); `out` (restore, read) is a writable C-contiguous buffer. The native cuda
backend also takes CuPy (any `__cuda_array_interface__`) arrays. `stream` is None, an integer
cudaStream_t, or an object with `.ptr` (a CuPy stream). With stream=None a call has finished with the
caller's buffers when it returns; with a stream, the caller keeps them alive until the stream has passed.
"""

from __future__ import annotations

import abc
import math
import operator
from dataclasses import dataclass, fields

import numpy as np

from ..errors import ClosedError, InvalidArgumentError, SizeMismatchError
from ..ggml_types import SUPPORTED_TYPES, block, type_name
from .abi import MAX_DIMS, TIER_AUTO, TIER_HOST, TIER_NAMES, TYPE_BYTES, TYPE_COUNT
from .strategy import Strategy

_TIER_BY_NAME = {name: code for code, name in TIER_NAMES.items()}


@dataclass(frozen=True)
class TensorDesc:
    """GGUF type and shape of an entry's bytes; shape is innermost first (GGUF order, numpy reversed)."""

    ggml_type: int = TYPE_BYTES
    shape: tuple = ()


@dataclass(frozen=True)
class EntryInfo:
    nbytes: int
    ggml_type: int
    shape: tuple     # GGUF order
    on_device: bool  # a device copy exists
    on_host: bool    # a host copy exists


@dataclass(frozen=True)
class StoreStats:
    """Fields exactly as struct pebble_stats (see pebble.h for each one's meaning)."""

    device_limit_bytes: int
    device_bytes: int
    device_peak_bytes: int
    host_bytes: int
    host_peak_bytes: int
    entries: int
    saves: int
    restores: int
    hits: int
    evictions: int
    prefetches: int
    bytes_h2d: int
    bytes_d2h: int
    bytes_restored: int


STATS_FIELDS = tuple(f.name for f in fields(StoreStats))


def as_int(value, what: str) -> int:
    """An integer argument (numpy integers included); anything else is an InvalidArgumentError."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}") from None


def tier_code(tier) -> int:
    """A tier given as a TIER_* constant or "auto"/"device"/"host". Unknown integers pass through so
    the backend reports them exactly as the native library does."""
    if isinstance(tier, str):
        try:
            return _TIER_BY_NAME[tier.lower()]
        except KeyError:
            raise InvalidArgumentError(f"unknown tier {tier!r}; valid: auto, device, host") from None
    if isinstance(tier, bool) or not isinstance(tier, int):
        raise InvalidArgumentError(f"tier must be a TIER_* constant or a name, got {tier!r}")
    return tier


def as_strategy(strategy) -> Strategy:
    return strategy if isinstance(strategy, Strategy) else Strategy.parse(strategy)


def default_desc(data, desc: TensorDesc | None) -> TensorDesc | None:
    """The desc to save with: the caller's, else the shape of a numpy/CuPy array as bytes, else None
    (plain bytes). Arrays of more than MAX_DIMS dimensions are saved as plain bytes."""
    if desc is not None:
        return desc
    if not (isinstance(data, np.ndarray) or hasattr(data, "__cuda_array_interface__")):
        return None
    if not 1 <= data.ndim <= MAX_DIMS:
        return None
    return TensorDesc(TYPE_BYTES, tuple(int(n) for n in reversed(data.shape)))


def checked_desc(call: str, key, desc: "TensorDesc | None", nbytes: int) -> "TensorDesc":
    """The stub's pebble_save checks of a desc (None: untyped bytes), as native/store.cu makes them."""
    if desc is None:
        return TensorDesc(TYPE_BYTES, (nbytes,))
    ggml_type, shape = as_int(desc.ggml_type, "ggml_type"), tuple(as_int(n, "shape") for n in desc.shape)
    if not (ggml_type == TYPE_BYTES or 0 <= ggml_type < TYPE_COUNT):
        raise InvalidArgumentError(f"{call}: layer {key[0]} tensor {key[1]}: unknown GGUF type "
                                   f"{ggml_type}; valid: {TYPE_BYTES} (bytes), 0..{TYPE_COUNT - 1}")
    if not 1 <= len(shape) <= MAX_DIMS:
        raise InvalidArgumentError(f"{call}: layer {key[0]} tensor {key[1]}: shape {shape} has "
                                   f"{len(shape)} dimensions; valid: 1..{MAX_DIMS}")
    check_desc_bytes(call, key, ggml_type, shape, nbytes)
    return TensorDesc(ggml_type, shape)


def check_desc_bytes(call: str, key, ggml_type: int, shape: tuple, nbytes: int) -> None:
    """The stub's pebble_save check that a desc's shape describes the bytes saved (native/store.cu's
    check_desc_bytes): no negative dimension; a type with kernels, rows of whole blocks and exactly its
    elements' bytes; untyped bytes, a whole number of bytes per element. A type without kernels is taken as
    described."""
    where, dims = f"{call}: layer {key[0]} tensor {key[1]}", "[" + ", ".join(map(str, shape)) + "]"
    if any(n < 0 for n in shape):
        raise InvalidArgumentError(f"{where}: shape {dims} has a negative dimension; each must be at least 0")
    elements = math.prod(shape)
    if ggml_type == TYPE_BYTES:
        if elements == 0 or elements >= 1 << 64 or nbytes % elements:
            raise SizeMismatchError(f"{where}: {nbytes} bytes are not a whole number of bytes for each element of "
                                    f"shape {dims}")
    elif ggml_type in SUPPORTED_TYPES:
        block_elements, block_bytes = block(ggml_type)
        if shape[0] % block_elements:
            raise SizeMismatchError(f"{where}: {type_name(ggml_type)} shape {dims}: the first dimension must be a "
                                    f"multiple of the type's {block_elements}-element blocks")
        need = elements // block_elements * block_bytes
        if elements >= 1 << 64 or need >= 1 << 64 or need != nbytes:
            raise SizeMismatchError(f"{where} holds {nbytes} bytes; {type_name(ggml_type)} shape {dims} needs "
                                    f"{need if need < 1 << 64 else 'more than 2^64'}")


def check_view(call: str, layer: int, tensor_id: int, nbytes: int, dtype, shape) -> tuple[np.dtype, tuple]:
    """dtype and shape of a view over an entry of `nbytes`, which they must cover exactly."""
    dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise InvalidArgumentError(f"{call}: layer {layer} tensor {tensor_id}: shape {shape} has a negative "
                                   "dimension; each must be at least 0")
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if want != nbytes:
        raise SizeMismatchError(f"{call}: layer {layer} tensor {tensor_id} holds {nbytes} bytes; "
                                f"{dtype} {shape} needs {want}")
    return dtype, shape


def stream_pointer(stream) -> int:
    """cudaStream_t as an integer: None -> 0 (default stream), an int, or an object's `.ptr`."""
    if stream is None:
        return 0
    ptr = getattr(stream, "ptr", stream)
    if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr < 0:
        raise InvalidArgumentError(f"stream must be None, an integer cudaStream_t or have .ptr, "
                                   f"got {stream!r}")
    return ptr


def host_buffer(obj, *, writable: bool, what: str) -> memoryview:
    """A flat byte view of a C-contiguous host buffer, without copying."""
    if hasattr(obj, "__cuda_array_interface__"):
        raise InvalidArgumentError(f"{what} is device memory ({type(obj).__name__}); this backend "
                                   f"holds host memory only: pass a numpy array or bytes")
    try:
        if isinstance(obj, np.ndarray):  # any dtype, including those memoryview cannot describe
            flat = obj.reshape(-1).view(np.uint8) if obj.flags.c_contiguous else obj
            view = memoryview(flat)
        else:
            view = memoryview(obj)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} must be a numpy array or a bytes-like buffer, got "
                                   f"{type(obj).__name__} ({exc})") from None
    if not view.c_contiguous:
        raise InvalidArgumentError(f"{what} must be C-contiguous (shape {view.shape}, strides "
                                   f"{view.strides})")
    if writable and view.readonly:
        raise InvalidArgumentError(f"{what} must be writable, got a read-only {type(obj).__name__}")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Store(abc.ABC):
    """A pebble store: entries keyed by (layer, tensor_id) across a bounded device tier and a host tier.

    Attributes: `backend` (the name of the backend it belongs to), `n_layers`, `device_limit` (bytes), `strategy`.
    Every failure raises a `pyplugin.errors.PebbleError` subclass; every call after `close()` raises
    `ClosedError`. A store is safe to use from several threads.
    """

    backend: str
    n_layers: int
    device_limit: int
    strategy: Strategy

    @abc.abstractmethod
    def save(self, layer: int, tensor_id: int, data, *, desc: TensorDesc | None = None,
             tier=TIER_AUTO, stream=None) -> None:
        """Saves `data` under (layer, tensor_id), replacing any entry there. TIER_AUTO places it on the
        device iff should_checkpoint(layer); saving to the device past the limit first moves the least
        recently used entries of other keys to the host tier."""

    def save_borrowed(self, layer: int, tensor_id: int, data, *, desc: TensorDesc | None = None) -> bool:
        """As save into the host tier, except that the store may keep `data` itself as the entry's host
        copy instead of copying it (pebble_save_borrowed): a weight viewed in a GGUF file's memory map
        then loads without a copy. Returns whether it did; then `data` must stay unchanged while the
        store lives (the store keeps a reference to it, and never writes into it: a write to the entry
        first gives it a copy of its own). This implementation copies."""
        self.save(layer, tensor_id, data, desc=desc, tier=TIER_HOST)
        return False

    @abc.abstractmethod
    def restore(self, layer: int, tensor_id: int, out, *, stream=None) -> None:
        """Copies the whole entry into `out`, whose size must equal the entry's."""

    @abc.abstractmethod
    def read(self, layer: int, tensor_id: int, offset: int, out, *, stream=None) -> None:
        """Copies bytes [offset, offset + out.nbytes) of the entry into `out`."""

    @abc.abstractmethod
    def write(self, layer: int, tensor_id: int, offset: int, data, *, stream=None) -> None:
        """Overwrites bytes [offset, offset + data.nbytes) of the entry in every tier holding it."""

    @abc.abstractmethod
    def erase(self, layer: int, tensor_id: int) -> None:
        """Removes the entry from both tiers."""

    @abc.abstractmethod
    def prefetch(self, layer: int, *, stream=None) -> None:
        """Copies the layer's host-only entries into the device tier as far as the limit allows
        without evicting other entries of that layer."""

    @abc.abstractmethod
    def keep_on_host(self, layer: int, tensor_id: int, keep: bool = True) -> None:
        """keep True keeps the entry in the host tier: a device copy moves there now, and set_strategy,
        prefetch and a save into the automatic tier leave it there (a save into the device tier still
        places it); False lets the strategy place it again. Lasts until the entry is erased."""

    @abc.abstractmethod
    def entry_info(self, layer: int, tensor_id: int) -> EntryInfo: ...

    @abc.abstractmethod
    def device_array(self, layer: int, tensor_id: int, dtype, shape: tuple[int, ...]):
        """The entry's device copy as an array of `dtype` and `shape`, without copying, to compute
        from (and write into) in place: a CuPy array on the cuda backend, numpy elsewhere.
        UnknownEntryError when it has no device copy, SizeMismatchError when dtype and shape do not
        cover the entry exactly.

        The view owns the memory it views: it stays valid memory (readable and writable, never freed
        under it) for as long as the array, or any array derived from it, lives. It aliases the entry
        while the copy it views is the entry's device copy: writes through it are writes to the entry,
        and a save of the same size to the device tier shows through it. Once the entry is evicted from
        the device tier, erased or saved again at another size or to the host tier, or the store is
        closed, the view is detached: it keeps the bytes it had, and writes through it reach neither
        the store nor any other store. A detached view's memory is not counted in the device tier's
        bytes (the device may hold more than the limit while such views live) and is freed when the
        view is."""

    @abc.abstractmethod
    def host_array(self, layer: int, tensor_id: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The entry's host copy as a numpy array of `dtype` and `shape`, without copying, to compute
        from in place where the kernels read host memory (host and stub: a streamed layer needs no
        copy there). UnknownEntryError when it has no host copy; the view owns its memory as
        device_array's does, and is detached once the store lets go of the host copy. Writes through
        it reach the host copy only."""

    @abc.abstractmethod
    def set_strategy(self, strategy, *, device_limit: int | None = None) -> None:
        """Changes the strategy (and the limit, when given) of the live store, then rebalances: device
        copies of layers now streamed move to the host tier, least-recently-used entries move there
        until the limit holds, and host-only entries of resident layers (ascending layer, then tensor
        id) move to the device as far as the limit allows. Nothing is saved again or dropped."""

    @abc.abstractmethod
    def should_checkpoint(self, layer: int) -> bool:
        """Whether the strategy keeps `layer` resident on the device."""

    @abc.abstractmethod
    def stats(self) -> StoreStats: ...

    @abc.abstractmethod
    def reset_stats(self) -> None:
        """Resets the peaks to the current holdings and zeroes the event counters."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Waits until every copy the store enqueued has completed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees every entry. Idempotent; every other call afterwards raises ClosedError."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"the {self.backend} store is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.device_limit} device bytes"
        return (f"<{type(self).__name__} backend={self.backend} layers={self.n_layers} "
                f"strategy={self.strategy} {state}>")


def check_attend_counts(k_caches, v_caches, n_pos) -> None:
    """pebble_attend reads n_seq entries of each of these, so they come in equal numbers (n_seq, the
    sequences, at least 1): refused here, before the library reads past the end of a shorter one."""
    counts = (len(k_caches), len(v_caches), len(n_pos))
    if counts[0] < 1 or len(set(counts)) > 1:
        raise SizeMismatchError(f"attend: {counts[0]} K caches, {counts[1]} V caches and {counts[2]} n_pos; one of "
                                "each per sequence (at least one sequence) is needed")

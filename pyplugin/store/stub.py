"""The pure-Python store: host memory, byte-accounted, and the reference semantics of native/pebble.h
(its kernels are in stub_kernels.py).

It needs no compiler and no GPU. Its "device tier" is numpy memory that is counted against the device
limit, so everything the native store decides (which entries are evicted, which restores are hits, how
many bytes cross the bus) comes out the same here, and the conformance suite holds the two together.

Rules the native library keeps too (native/store.cu):
- A call that fails changes nothing.
- Saving over an entry of the same size reuses it: a copy already in the target tier is overwritten
  in place, and a copy in the other tier is released only after the new one is in place. A different
  size releases the old copies first.
- A device_array view keeps the memory it views alive (numpy's base here, a lease in store.cu). Once
  the store lets go of that copy (eviction, erase, a save at another size or to the host tier, close)
  the view is detached: it keeps its last bytes, readable and writable, and aliases nothing the store
  holds any more.
- Least-recently-used order covers every entry and is touched by each call that copies an entry's
  bytes for the caller: save, restore, read, write, and prefetch (the entries it copies).
- Eviction walks that order oldest first over the entries that have a device copy, skipping the key
  being saved (save) or the whole layer (prefetch). An evicted entry without a host copy is copied to
  the host tier; one that has a host copy (left there by prefetch) just drops its device copy. Both
  count as an eviction.
- Prefetch walks the layer's host-only entries by ascending tensor id; it skips, evicting nothing for
  it, an entry that does not fit beside the layer's entries already on the device, and keeps the host
  copy of those it copies. set_strategy evicts the device copies of streamed layers (ascending key),
  then least-recently-used ones down to the limit, then copies host-only entries of resident layers to
  the device (ascending key) as far as they fit, counting those as prefetches. Both leave an entry kept
  on the host (keep_on_host) where it is.
- bytes_h2d / bytes_d2h count every byte copied between host memory and device memory by any call,
  tier to tier (eviction, prefetch) and between a caller's buffer and a tier (save, restore, read,
  write: each tier written counts once). The caller's buffer is classified by where it lives: here,
  and in the native host build, it is always host memory; the cuda build asks CUDA. So a save of host
  data to the device tier counts h2d, a restore of a device copy into host memory counts d2h, and
  host-to-host or device-to-device copies count neither.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import wraps

import numpy as np

from ..errors import (
    HostOutOfMemoryError, InvalidArgumentError, LayerRangeError, SizeMismatchError, TooLargeError,
    UnknownEntryError,
)
from .abi import INT32_MAX, TIER_AUTO, TIER_DEVICE, TIER_NAMES
from .interface import (
    EntryInfo, Store, StoreStats, TensorDesc, as_int, as_strategy, check_view, checked_desc, default_desc, host_buffer,
    stream_pointer, tier_code,
)
from .strategy import is_resident, resident_count
_EVENT_COUNTERS = ("saves", "restores", "hits", "evictions", "prefetches", "bytes_h2d", "bytes_d2h",
                   "bytes_restored")


@dataclass
class _Entry:
    nbytes: int
    desc: TensorDesc
    device: np.ndarray | None = None  # the device-tier copy (uint8)
    host: np.ndarray | None = None    # the host-tier copy (uint8)
    kept: bool = False                # keep_on_host: the strategy leaves it in the host tier


def _locked(method):
    """Runs the method under the store's lock, after refusing a closed store."""
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            if self._entries is None:
                raise self._closed_error()
            return method(self, *args, **kwargs)
    return wrapper


def _alloc_copy(src, what: str) -> np.ndarray:
    try:
        return np.array(src, dtype=np.uint8, copy=True)
    except MemoryError:
        raise HostOutOfMemoryError(f"{what}: could not allocate {len(src)} bytes") from None


class StubStore(Store):
    backend = "stub"

    def __init__(self, device_limit: int, n_layers: int, strategy, *, device: int = 0):
        self.device_limit = as_int(device_limit, "device_limit")
        self.n_layers = as_int(n_layers, "n_layers")
        self.strategy = as_strategy(strategy)
        if self.device_limit < 0:
            raise InvalidArgumentError(f"init: device limit must be >= 0 bytes, got {self.device_limit}")
        if self.n_layers < 1:
            raise InvalidArgumentError(f"init: n_layers must be >= 1, got {self.n_layers}")
        if as_int(device, "device") < 0:
            raise InvalidArgumentError(f"init: device {device} is negative")  # else unused: host memory
        resident_count(self.strategy.code, self.strategy.arg, self.n_layers)  # StrategyError if invalid
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, int], _Entry] | None = OrderedDict()  # oldest first
        self._device_bytes = self._host_bytes = 0
        self._device_peak = self._host_peak = 0
        self._counters = dict.fromkeys(_EVENT_COUNTERS, 0)

    # -- argument checks, shared by the calls below

    def _layer(self, call: str, layer) -> int:
        layer = as_int(layer, "layer")
        if not 0 <= layer < self.n_layers:
            raise LayerRangeError(f"{call}: layer {layer} out of range [0, {self.n_layers})")
        return layer

    def _key(self, call: str, layer, tensor_id) -> tuple[int, int]:
        layer = self._layer(call, layer)
        tensor_id = as_int(tensor_id, "tensor_id")
        if not 0 <= tensor_id <= INT32_MAX:
            raise InvalidArgumentError(f"{call}: layer {layer} tensor {tensor_id}: tensor id must be "
                                       f"in [0, {INT32_MAX}]")
        return layer, tensor_id

    def _entry(self, call: str, key: tuple[int, int]) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise UnknownEntryError(f"{call}: no entry saved under layer {key[0]} tensor {key[1]}")
        return entry

    @staticmethod
    def _buffer(call: str, key, obj, *, writable: bool) -> memoryview:
        view = host_buffer(obj, writable=writable, what=f"{call} layer {key[0]} tensor {key[1]} buffer")
        if view.nbytes == 0:
            raise InvalidArgumentError(f"{call}: layer {key[0]} tensor {key[1]}: size is 0 bytes")
        return view

    def _range(self, call: str, key, entry: _Entry, offset, nbytes: int) -> int:
        offset = as_int(offset, "offset")
        if offset < 0:
            raise InvalidArgumentError(f"{call}: layer {key[0]} tensor {key[1]}: offset {offset} < 0")
        if offset + nbytes > entry.nbytes:
            raise SizeMismatchError(f"{call}: layer {key[0]} tensor {key[1]}: bytes [{offset}, "
                                    f"{offset + nbytes}) are past the entry's {entry.nbytes} bytes")
        return offset

    # -- tier bookkeeping

    def _touch(self, key) -> None:
        self._entries.move_to_end(key)

    def _add_device(self, entry: _Entry, copy: np.ndarray) -> None:
        entry.device = copy
        self._device_bytes += entry.nbytes
        self._device_peak = max(self._device_peak, self._device_bytes)

    def _add_host(self, entry: _Entry, copy: np.ndarray) -> None:
        entry.host = copy
        self._host_bytes += entry.nbytes
        self._host_peak = max(self._host_peak, self._host_bytes)

    def _drop_device(self, entry: _Entry) -> None:
        if entry.device is not None:
            self._device_bytes -= entry.nbytes
            entry.device = None

    def _drop_host(self, entry: _Entry) -> None:
        if entry.host is not None:
            self._host_bytes -= entry.nbytes
            entry.host = None

    def _evict(self, entry: _Entry) -> None:
        if entry.host is None:
            # A copy, not the device array itself: a device_array view of it may outlive the eviction,
            # and must then no longer alias the entry (as store.cu's detached buffers do not).
            self._add_host(entry, entry.device.copy())
            self._counters["bytes_d2h"] += entry.nbytes
        self._drop_device(entry)
        self._counters["evictions"] += 1

    def _make_room(self, nbytes: int, spare) -> None:
        """Evicts least-recently-used device copies, except keys for which spare(key) is true, until
        nbytes more fit in the device tier. Callers have checked that enough can be evicted."""
        for key, entry in self._entries.items():
            if self._device_bytes + nbytes <= self.device_limit:
                return
            if entry.device is not None and not spare(key):
                self._evict(entry)

    def _copy_to_device(self, key, entry: _Entry) -> None:
        """Gives a host-only entry a device copy too (prefetch, rebalancing)."""
        self._add_device(entry, entry.host.copy())
        self._touch(key)
        self._counters["prefetches"] += 1
        self._counters["bytes_h2d"] += entry.nbytes

    # -- the calls

    @_locked
    def save(self, layer, tensor_id, data, *, desc=None, tier=TIER_AUTO, stream=None):
        key = self._key("save", layer, tensor_id)
        tier = tier_code(tier)
        if tier not in TIER_NAMES:
            raise InvalidArgumentError(f"save: layer {key[0]} tensor {key[1]}: unknown tier {tier}; "
                                       f"valid: 0 auto, 1 device, 2 host")
        stream_pointer(stream)
        src = self._buffer("save", key, data, writable=False)
        nbytes = src.nbytes
        entry = _Entry(nbytes, checked_desc("save", key, default_desc(data, desc), nbytes))
        old = self._entries.get(key)
        to_device = tier == TIER_DEVICE or (tier == TIER_AUTO and not (old and old.kept) and is_resident(
            self.strategy.code, self.strategy.arg, self.n_layers, key[0]))
        if to_device and nbytes > self.device_limit:
            raise TooLargeError(f"save: layer {key[0]} tensor {key[1]}: {nbytes} bytes bound for the "
                                f"device tier exceed its whole limit of {self.device_limit} bytes")
        copy = _alloc_copy(src, f"save: layer {key[0]} tensor {key[1]}")
        if old is not None and old.nbytes == nbytes:
            # The same size reuses the entry's copies: the copy in the other tier is released only once
            # the new one is in place (so the peaks count both, as in store.cu).
            old.desc, entry = entry.desc, old
        else:
            if old is not None:
                self._drop_device(old)
                self._drop_host(old)
                entry.kept = old.kept
            self._entries[key] = entry
        if to_device:
            if entry.device is None:
                self._make_room(nbytes, spare=lambda k: k == key)
                self._add_device(entry, copy)
            else:
                entry.device[:] = copy  # in place, as store.cu: device_array views see the new bytes
            self._counters["bytes_h2d"] += nbytes
            self._drop_host(entry)
        else:
            if entry.host is None:
                self._add_host(entry, copy)
            else:
                entry.host = copy
            self._drop_device(entry)
        self._touch(key)
        self._counters["saves"] += 1

    def _copy_out(self, key, entry: _Entry, offset: int, dst: memoryview) -> None:
        hit = entry.device is not None
        src = entry.device if hit else entry.host
        np.frombuffer(dst, dtype=np.uint8)[:] = src[offset:offset + dst.nbytes]
        self._touch(key)
        counters = self._counters
        counters["restores"] += 1
        counters["hits"] += hit
        counters["bytes_restored"] += dst.nbytes
        if hit:
            counters["bytes_d2h"] += dst.nbytes

    @_locked
    def restore(self, layer, tensor_id, out, *, stream=None):
        key = self._key("restore", layer, tensor_id)
        stream_pointer(stream)
        dst = self._buffer("restore", key, out, writable=True)
        entry = self._entry("restore", key)
        if dst.nbytes != entry.nbytes:
            raise SizeMismatchError(f"restore: layer {key[0]} tensor {key[1]}: buffer is {dst.nbytes} "
                                    f"bytes, the entry is {entry.nbytes} bytes")
        self._copy_out(key, entry, 0, dst)

    @_locked
    def read(self, layer, tensor_id, offset, out, *, stream=None):
        key = self._key("read", layer, tensor_id)
        stream_pointer(stream)
        dst = self._buffer("read", key, out, writable=True)
        entry = self._entry("read", key)
        offset = self._range("read", key, entry, offset, dst.nbytes)
        self._copy_out(key, entry, offset, dst)

    @_locked
    def write(self, layer, tensor_id, offset, data, *, stream=None):
        key = self._key("write", layer, tensor_id)
        stream_pointer(stream)
        src = np.frombuffer(self._buffer("write", key, data, writable=False), dtype=np.uint8)
        entry = self._entry("write", key)
        offset = self._range("write", key, entry, offset, src.nbytes)
        end = offset + src.nbytes
        if entry.device is not None:
            entry.device[offset:end] = src
            self._counters["bytes_h2d"] += src.nbytes
        if entry.host is not None:
            entry.host[offset:end] = src
        self._touch(key)

    @_locked
    def erase(self, layer, tensor_id):
        key = self._key("erase", layer, tensor_id)
        entry = self._entry("erase", key)
        self._drop_device(entry)
        self._drop_host(entry)
        del self._entries[key]

    @_locked
    def prefetch(self, layer, *, stream=None):
        layer = self._layer("prefetch", layer)
        stream_pointer(stream)
        mine = sorted((k for k in self._entries if k[0] == layer), key=lambda k: k[1])
        resident = sum(self._entries[k].nbytes for k in mine if self._entries[k].device is not None)
        for key in mine:
            entry = self._entries[key]
            if entry.device is not None or entry.kept or resident + entry.nbytes > self.device_limit:
                continue
            self._make_room(entry.nbytes, spare=lambda k: k[0] == layer)
            self._copy_to_device(key, entry)
            resident += entry.nbytes

    @_locked
    def keep_on_host(self, layer, tensor_id, keep=True):
        key = self._key("keep_on_host", layer, tensor_id)
        entry = self._entry("keep_on_host", key)
        entry.kept = bool(keep)
        if entry.kept and entry.device is not None:
            self._evict(entry)

    @_locked
    def device_array(self, layer, tensor_id, dtype, shape):
        key = self._key("device_array", layer, tensor_id)
        entry = self._entry("device_array", key)
        if entry.device is None:
            raise UnknownEntryError(f"device_array: layer {key[0]} tensor {key[1]} has no device copy "
                                    f"(it is in the host tier)")
        dtype, shape = check_view("device_array", *key, entry.nbytes, dtype, shape)
        self._touch(key)
        return entry.device.view(dtype).reshape(shape)

    @_locked
    def host_array(self, layer, tensor_id, dtype, shape):
        key = self._key("host_array", layer, tensor_id)
        entry = self._entry("host_array", key)
        if entry.host is None:
            raise UnknownEntryError(f"pebble_host_acquire: layer {key[0]} tensor {key[1]} has no host copy (it "
                                    f"is in the device tier only)")
        dtype, shape = check_view("host_array", *key, entry.nbytes, dtype, shape)
        return entry.host.view(dtype).reshape(shape)

    @_locked
    def entry_info(self, layer, tensor_id) -> EntryInfo:
        key = self._key("entry_info", layer, tensor_id)
        entry = self._entry("entry_info", key)
        return EntryInfo(entry.nbytes, entry.desc.ggml_type, entry.desc.shape,
                         entry.device is not None, entry.host is not None)

    @_locked
    def set_strategy(self, strategy, *, device_limit=None) -> None:
        strategy = as_strategy(strategy)
        limit = self.device_limit if device_limit is None else as_int(device_limit, "device_limit")
        if limit < 0:
            raise InvalidArgumentError(f"set_strategy: device limit must be >= 0 bytes, got {limit}")
        resident_count(strategy.code, strategy.arg, self.n_layers)  # StrategyError if invalid
        self.strategy, self.device_limit = strategy, limit
        keys = sorted(self._entries)  # ascending layer, then tensor id

        def resident(key) -> bool:
            return not self._entries[key].kept and is_resident(strategy.code, strategy.arg, self.n_layers, key[0])

        for key in keys:
            if self._entries[key].device is not None and not resident(key):
                self._evict(self._entries[key])
        self._make_room(0, spare=lambda k: False)
        for key in keys:
            entry = self._entries[key]
            if resident(key) and entry.device is None and self._device_bytes + entry.nbytes <= limit:
                self._copy_to_device(key, entry)

    @_locked
    def should_checkpoint(self, layer) -> bool:
        layer = self._layer("should_checkpoint", layer)
        return is_resident(self.strategy.code, self.strategy.arg, self.n_layers, layer)

    @_locked
    def stats(self) -> StoreStats:
        return StoreStats(device_limit_bytes=self.device_limit, device_bytes=self._device_bytes,
                          device_peak_bytes=self._device_peak, host_bytes=self._host_bytes,
                          host_peak_bytes=self._host_peak, entries=len(self._entries), **self._counters)

    @_locked
    def reset_stats(self) -> None:
        self._device_peak, self._host_peak = self._device_bytes, self._host_bytes
        self._counters = dict.fromkeys(_EVENT_COUNTERS, 0)

    @_locked
    def synchronize(self) -> None:
        pass  # every copy here is done when its call returns

    def close(self) -> None:
        with self._lock:
            self._entries = None

    @property
    def closed(self) -> bool:
        return self._entries is None

"""device_array views own the memory they view, on every backend (tests/conftest.py's store_backend).

A view outlives what the store keeps of the entry in five ways: close, erase, eviction, a save at another
size, and the store's finalizer. After each, the stale view must read the bytes it had, writes through
it must reach neither the store's live entries nor a store opened afterwards (in the native library a
freed buffer would be handed to the next allocation), and its memory must be freed when it goes.
numpy and Python are not instrumented in the sanitized run (make test-sanitized), so the tests compare
bytes rather than count on AddressSanitizer seeing a stale read; it does stop the run on a double free,
and tests/native/test_pebble.c checks under LeakSanitizer that the last release frees a detached buffer.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

import helpers
from helpers import restored, to_host
from pyplugin.errors import InvalidArgumentError, UnknownEntryError
from pyplugin.store import TIER_DEVICE, TIER_HOST, native
from pyplugin.store.backend import open_store

N = 256  # bytes per entry


@pytest.fixture
def make_store(store_backend):
    """Opens stores on the backend under test and closes them after the test."""
    opened = []

    def make(device_limit: int = 4 * N, n_layers: int = 2, strategy="none"):
        store = open_store(device_limit, n_layers, strategy, backend=store_backend)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def pattern(seed: int, nbytes: int = N) -> np.ndarray:
    return helpers.pattern(seed, nbytes)


def two_entries_and_a_view(store):
    """Entries (0, 0) and (0, 1) on the device, and a view of (0, 0); returns (view, bytes of both)."""
    first, second = pattern(1), pattern(2)
    store.save(0, 0, first, tier=TIER_DEVICE)
    store.save(0, 1, second, tier=TIER_DEVICE)
    view = store.device_array(0, 0, np.uint8, (N,))
    assert np.array_equal(to_host(view), first)
    return view, first, second


def assert_stale(backend: str, view, had: np.ndarray, store=None, live=None) -> None:
    """The view reads `had`; writing through it changes none of the `live` entries of `store` ({key:
    bytes}, restored and compared) nor a store of `backend` opened afterwards."""
    assert np.array_equal(to_host(view), had)
    view[...] = 0xAB
    assert (to_host(view) == 0xAB).all()  # still writable memory of its own
    for key, expected in (live or {}).items():
        assert np.array_equal(restored(store, *key), expected), key
    with open_store(4 * N, 2, "none", backend=backend) as other:
        fresh = pattern(3)
        other.save(0, 0, fresh, tier=TIER_DEVICE)  # the size the view had: the likeliest to reuse it
        view[...] = 0xCD
        assert np.array_equal(restored(other, 0, 0), fresh)
        assert np.array_equal(to_host(other.device_array(0, 0, np.uint8, (N,))), fresh)
    assert (to_host(view) == 0xCD).all()


# ---------------------------------------------------------------------------------------------------
# the five ways a view outlives the entry's device copy


def test_a_view_outlives_close(store_backend, make_store):
    store = make_store()
    view, first, _ = two_entries_and_a_view(store)
    derived = view.reshape(4, N // 4)[1:]  # an array made from the view holds the memory too
    store.close()
    gc.collect()
    assert np.array_equal(to_host(derived), first.reshape(4, N // 4)[1:])
    assert_stale(store_backend, view, first)


def test_a_view_outlives_erase(store_backend, make_store):
    store = make_store()
    view, first, second = two_entries_and_a_view(store)
    store.erase(0, 0)
    with pytest.raises(UnknownEntryError):
        store.entry_info(0, 0)
    assert store.stats().device_bytes == N  # the view's memory is no longer the store's
    assert_stale(store_backend, view, first, store, {(0, 1): second})


def test_a_view_outlives_eviction_by_set_strategy(store_backend, make_store):
    store = make_store()
    view, first, second = two_entries_and_a_view(store)
    store.set_strategy("minimal", device_limit=0)
    assert not store.entry_info(0, 0).on_device and store.stats().device_bytes == 0
    assert_stale(store_backend, view, first, store, {(0, 0): first, (0, 1): second})


def test_a_view_outlives_eviction_by_a_save(store_backend, make_store):
    store = make_store(device_limit=2 * N)
    view, first, second = two_entries_and_a_view(store)
    third = pattern(4)
    store.save(1, 0, third, tier=TIER_DEVICE)  # least recently used: (0, 1), then (0, 0) moves to host
    store.save(1, 1, third, tier=TIER_DEVICE)
    assert not store.entry_info(0, 0).on_device
    live = {(0, 0): first, (0, 1): second, (1, 0): third, (1, 1): third}
    assert_stale(store_backend, view, first, store, live)


def test_a_view_outlives_a_save_at_another_size(store_backend, make_store):
    store = make_store()
    view, first, second = two_entries_and_a_view(store)
    bigger = pattern(5, 2 * N)
    store.save(0, 0, bigger, tier=TIER_DEVICE)
    assert store.entry_info(0, 0).nbytes == 2 * N
    assert_stale(store_backend, view, first, store, {(0, 0): bigger, (0, 1): second})


def test_a_view_outlives_the_store_being_dropped(store_backend):
    store = open_store(4 * N, 2, "none", backend=store_backend)
    view, first, _ = two_entries_and_a_view(store)
    dropped = weakref.ref(store)
    del store
    gc.collect()
    assert dropped() is None  # the view does not keep the store alive
    assert_stale(store_backend, view, first)


# ---------------------------------------------------------------------------------------------------
# while the view is the entry's copy, it is the entry


def test_a_save_of_the_same_size_to_the_device_shows_through_the_view(make_store):
    store = make_store()
    view, _, _ = two_entries_and_a_view(store)
    again = pattern(6)
    store.save(0, 0, again, tier=TIER_DEVICE)
    assert np.array_equal(to_host(view), again)
    view[:4] = 7
    again[:4] = 7
    assert np.array_equal(restored(store, 0, 0), again)


def test_a_save_to_the_host_tier_detaches_the_view(store_backend, make_store):
    store = make_store()
    view, first, second = two_entries_and_a_view(store)
    again = pattern(7)
    store.save(0, 0, again, tier=TIER_HOST)
    assert_stale(store_backend, view, first, store, {(0, 0): again, (0, 1): second})


def test_views_taken_and_dropped_across_threads_while_the_store_changes(make_store):
    store = make_store(device_limit=2 * N, n_layers=4)
    for layer in range(4):
        store.save(layer, 0, np.full(N, layer, np.uint8), tier=TIER_DEVICE)
    errors = []

    def viewer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                layer = int(rng.integers(4))
                try:
                    view = store.device_array(layer, 0, np.uint8, (N,))
                except UnknownEntryError:
                    continue  # evicted meanwhile
                assert (to_host(view) == layer).all()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def churner() -> None:
        try:
            for step in range(200):
                layer = step % 4
                store.save(layer, 0, np.full(N, layer, np.uint8), tier=TIER_DEVICE)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=viewer, args=(seed,)) for seed in range(3)]
    threads.append(threading.Thread(target=churner))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert store.stats().device_bytes <= 2 * N


# ---------------------------------------------------------------------------------------------------
# leases in the native library


@pytest.fixture
def native_store(store_backend, make_store):
    if store_backend == "stub":
        pytest.skip("leases are the native library's")
    return make_store()


def acquire(store, layer: int, tensor_id: int):
    out, size = native.ffi.new("void **"), native.ffi.new("uint64_t *")
    native._check(store._lib, store._lib.pebble_device_acquire(store._handle, layer, tensor_id, out, size))
    return out[0], int(size[0])


def release(lib, ptr) -> None:
    native._check(lib, lib.pebble_device_release(ptr))


def address(view) -> int:
    return view.data.ptr if hasattr(view, "get") else view.ctypes.data


def test_a_release_without_a_lease_is_an_invalid_argument(native_store):
    lib = native_store._lib
    with pytest.raises(InvalidArgumentError, match="pebble_device_release: .* holds no lease"):
        release(lib, native.ffi.cast("void *", 0x1000))
    with pytest.raises(InvalidArgumentError, match="NULL"):
        release(lib, native.ffi.NULL)
    native_store.save(0, 0, pattern(1), tier=TIER_DEVICE)
    borrowed = native.ffi.new("void **")
    native._check(lib, lib.pebble_device_pointer(native_store._handle, 0, 0, borrowed))
    with pytest.raises(InvalidArgumentError, match="holds no lease"):
        release(lib, borrowed[0])  # a borrowed pointer holds none


def test_acquire_fails_as_device_pointer_does(native_store):
    native_store.save(0, 0, pattern(1), tier=TIER_HOST)
    with pytest.raises(UnknownEntryError, match="no device copy"):
        acquire(native_store, 0, 0)
    with pytest.raises(UnknownEntryError):
        acquire(native_store, 0, 5)


def test_leases_nest_and_the_last_release_frees_a_detached_buffer(native_store):
    lib = native_store._lib
    native_store.save(0, 0, pattern(1), tier=TIER_DEVICE)
    ptr, nbytes = acquire(native_store, 0, 0)
    again, _ = acquire(native_store, 0, 0)
    assert (ptr, nbytes) == (again, N)
    release(lib, ptr)             # one of two: still leased
    native_store.erase(0, 0)      # detached, not freed
    assert native_store.stats().device_bytes == 0
    release(lib, ptr)             # the last: freed here (a double free would stop the sanitized run)
    with pytest.raises(InvalidArgumentError, match="holds no lease"):
        release(lib, ptr)


def test_a_lease_is_given_back_after_the_store_is_freed(native_store):
    lib = native_store._lib
    native_store.save(0, 0, pattern(1), tier=TIER_DEVICE)
    ptr, _ = acquire(native_store, 0, 0)
    native_store.close()
    release(lib, ptr)
    with pytest.raises(InvalidArgumentError, match="holds no lease"):
        release(lib, ptr)


def test_a_lease_released_while_the_entry_keeps_its_copy_leaves_the_copy_alone(native_store):
    lib = native_store._lib
    data = pattern(1)
    native_store.save(0, 0, data, tier=TIER_DEVICE)
    ptr, _ = acquire(native_store, 0, 0)
    release(lib, ptr)
    assert np.array_equal(restored(native_store, 0, 0), data)  # still the entry's, still intact
    assert native_store.stats().device_bytes == N


def test_a_view_holds_one_lease_and_gives_it_back_when_dropped(native_store):
    lib = native_store._lib
    native_store.save(0, 0, pattern(1), tier=TIER_DEVICE)
    view = native_store.device_array(0, 0, np.uint8, (N,))
    ptr, _ = acquire(native_store, 0, 0)
    assert address(view) == int(native.ffi.cast("uintptr_t", ptr))
    release(lib, ptr)             # ours; the view's remains
    native_store.close()
    del view
    gc.collect()                  # the view's lease went with it, freeing the detached buffer
    with pytest.raises(InvalidArgumentError, match="holds no lease"):
        release(lib, ptr)


def test_a_refused_view_holds_no_lease(native_store):
    lib = native_store._lib
    native_store.save(0, 0, pattern(1), tier=TIER_DEVICE)
    ptr, _ = acquire(native_store, 0, 0)
    release(lib, ptr)
    with pytest.raises(Exception, match="256 bytes"):
        native_store.device_array(0, 0, np.float32, (N,))  # the wrong size: the lease is given back
    gc.collect()
    with pytest.raises(InvalidArgumentError, match="holds no lease"):
        release(lib, ptr)


# ---------------------------------------------------------------------------------------------------
# prefetched copies (on the host library, the host copy's own buffer)


@pytest.mark.parametrize("how", ["set_strategy", "erase", "host save", "close"])
def test_a_view_of_a_prefetched_copy_outlives_it(store_backend, make_store, how):
    """A device copy made from the host tier (which on the host library is the host copy's own bytes,
    not a second buffer) behaves as any device copy: once the store lets go of it, its view is
    detached from the entry, whose bytes stay what they were."""
    store = make_store()
    first, second = pattern(11), pattern(12)
    store.save(0, 0, first, tier=TIER_HOST)
    store.save(0, 1, second, tier=TIER_HOST)
    store.set_strategy("none", device_limit=4 * N)
    assert store.entry_info(0, 0).on_device and store.entry_info(0, 0).on_host
    view = store.device_array(0, 0, np.uint8, (N,))
    changed = first
    live = {(0, 1): second}
    if how == "set_strategy":
        store.set_strategy("minimal", device_limit=0)
        live[(0, 0)] = changed
    elif how == "erase":
        store.erase(0, 0)
    elif how == "host save":
        third = pattern(13)
        store.save(0, 0, third, tier=TIER_HOST)
        live[(0, 0)] = third
    else:
        store.close()
        live = {}
    assert_stale(store_backend, view, changed, store if live else None, live)


@pytest.mark.parametrize("store_backend", helpers.store_backend_params(("host",)))
def test_on_the_host_library_a_prefetch_takes_no_second_copy(store_backend):
    """The host library's device tier is host memory: a layer made resident from the host tier computes
    from the host copy's bytes, so the process's resident memory does not grow by them."""

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    big = 64 << 20
    with open_store(2 * big, 1, "minimal", backend=store_backend) as store:
        store.save(0, 0, np.ones(big, np.uint8), tier=TIER_HOST)
        before = rss()
        store.set_strategy("none", device_limit=2 * big)
        assert store.entry_info(0, 0).on_device
        assert np.asarray(store.device_array(0, 0, np.uint8, (big,)))[::4096].all()  # every page read
        assert rss() - before < big // 4, (rss() - before) / 2**20


def test_a_host_view_reads_the_host_copy_and_outlives_it(store_backend, make_store):
    """host_array: the host copy without copying (a streamed layer on host memory is computed from it);
    an entry with no host copy is refused; once the entry is erased the view is detached."""
    store = make_store()
    first, second = pattern(21), pattern(22)
    store.save(0, 0, first, tier=TIER_HOST)
    store.save(0, 1, second, tier=TIER_DEVICE)
    view = store.host_array(0, 0, np.uint8, (N,))
    assert np.array_equal(view, first)
    with pytest.raises(UnknownEntryError, match="no host copy"):
        store.host_array(0, 1, np.uint8, (N,))
    store.erase(0, 0)
    assert np.array_equal(view, first)
    if store_backend != "stub":  # the stub's view is its numpy array, kept alive by numpy itself
        view[...] = 0xAB
        assert np.array_equal(restored(store, 0, 1), second)

"""save_borrowed (pebble_save_borrowed): the host library keeps the caller's bytes as an entry's host copy
instead of copying them (a weight in a GGUF file's memory map loads without a copy); the cuda library and
the stub copy. On every backend the entry reads as the bytes given, and the store never writes into
them nor frees them: writes and saves give the entry a copy of its own first, and erase, eviction and
close leave the caller's bytes as they were. The sanitized run (make test-sanitized) runs these too, so
a free of borrowed bytes stops it.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import helpers
from helpers import restored, to_host
from pyplugin.model.gguf_file import map_file_pages
from pyplugin.store import TIER_DEVICE
from pyplugin.store.backend import open_store

N = 4096  # bytes per entry


def pattern(seed: int, nbytes: int = N) -> np.ndarray:
    return helpers.pattern(seed, nbytes)


@pytest.fixture
def store(store_backend):
    with open_store(4 * N, 2, "none", backend=store_backend) as s:
        yield s


def test_the_host_library_keeps_the_bytes_and_the_others_copy_them(store_backend, store):
    src = pattern(1)
    kept = store.save_borrowed(0, 0, src)
    assert kept == (store_backend == "host")
    assert np.array_equal(restored(store, 0, 0), src)
    info, stats = store.entry_info(0, 0), store.stats()
    assert info.on_host and not info.on_device
    assert stats.host_bytes == N and stats.saves == 1
    if kept:  # no copy: the host tier's view is the caller's memory itself
        view = store.host_array(0, 0, np.uint8, (N,))
        assert view.__array_interface__["data"][0] == src.__array_interface__["data"][0]
    else:
        src[:] = 0  # a copy: the entry does not see the caller's later changes
        assert np.array_equal(restored(store, 0, 0), pattern(1))


def test_a_write_gives_the_entry_bytes_of_its_own(store):
    src = pattern(2)
    store.save_borrowed(0, 0, src)
    store.write(0, 0, 100, np.full(50, 7, np.uint8))
    expected = pattern(2)
    assert np.array_equal(src, expected)  # never written
    expected[100:150] = 7
    assert np.array_equal(restored(store, 0, 0), expected)


def test_a_save_of_the_same_size_leaves_the_borrowed_bytes_alone(store):
    src = pattern(3)
    store.save_borrowed(0, 0, src)
    store.save(0, 0, pattern(4), tier=TIER_DEVICE)
    assert np.array_equal(src, pattern(3))
    assert np.array_equal(restored(store, 0, 0), pattern(4))
    store.save(0, 0, pattern(5))  # and to the host tier
    assert np.array_equal(src, pattern(3))
    assert np.array_equal(restored(store, 0, 0), pattern(5))


def test_prefetch_eviction_erase_and_close_leave_the_bytes_as_they_were(store_backend):
    src, other = pattern(6), pattern(7)
    with open_store(N, 2, "none", backend=store_backend) as store:  # room for one entry on the device
        store.save_borrowed(0, 0, src)
        store.save_borrowed(0, 1, other)
        store.prefetch(0)                        # one of them to the device tier
        on_device = [t for t in (0, 1) if store.entry_info(0, t).on_device]
        assert len(on_device) == 1
        view = store.device_array(0, on_device[0], np.uint8, (N,))
        assert np.array_equal(to_host(view), (src, other)[on_device[0]])
        store.set_strategy("minimal", device_limit=N)  # evicted back to the host tier
        assert not store.entry_info(0, on_device[0]).on_device
        assert np.array_equal(to_host(view), (src, other)[on_device[0]])  # the view still reads them
        del view
        store.erase(0, 1)
        assert np.array_equal(restored(store, 0, 0), pattern(6))
        store.save_borrowed(0, 0, other)  # borrowing again replaces the entry
        assert np.array_equal(restored(store, 0, 0), pattern(7))
    assert np.array_equal(src, pattern(6)) and np.array_equal(other, pattern(7))


def test_a_file_map_is_borrowed_read_only_and_its_pages_mapped(tmp_path, store_backend):
    """What PebbledModel does with a weight: a view of a read-only file map, whose pages are mapped up
    front. A write into the map would fault (it is PROT_READ), so writing to the entry proves the store
    wrote into a copy of its own."""
    path = tmp_path / "weights.bin"
    path.write_bytes(pattern(8, 3 * N).tobytes())
    with open(path, "rb") as f:
        file_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    weight = np.frombuffer(file_map, np.uint8, N, N)
    map_file_pages(weight)
    with open_store(4 * N, 2, "none", backend=store_backend) as store:
        store.save_borrowed(1, 0, weight)
        assert np.array_equal(restored(store, 1, 0), pattern(8, 3 * N)[N:2 * N])
        store.write(1, 0, 0, np.zeros(16, np.uint8))
        assert np.array_equal(weight, pattern(8, 3 * N)[N:2 * N])
        assert not restored(store, 1, 0)[:16].any()
    del weight, store  # the store held on to what it borrowed until now
    file_map.close()

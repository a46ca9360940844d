"""One suite for every store backend (stub, host, cuda): the semantics of native/pebble.h.

Each test takes the `store_backend` fixture (tests/conftest.py) and so runs once per backend present.
Sizes are small so that the whole suite takes seconds per backend.
"""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest

from helpers import store_backend_params
from pyplugin.store import strategy as strategies
from pyplugin.store.backend import backend_named, open_store, probe, select_backend
from pyplugin.errors import (
    ClosedError, InvalidArgumentError, LayerRangeError, PebblingError, SizeMismatchError, StrategyError,
    TooLargeError, UnknownEntryError,
)
from pyplugin.store import TIER_AUTO, TIER_DEVICE, TIER_HOST, EntryInfo, StoreStats, TensorDesc
from pyplugin.store.strategy import Strategy

@pytest.fixture
def make_store(store_backend):
    """Opens stores on the backend under test and closes them after the test."""
    opened = []

    def make(device_limit: int = 1024, n_layers: int = 4, strategy="none"):
        store = open_store(device_limit, n_layers, strategy, backend=store_backend)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def random_bytes(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def restored(store, layer: int, tensor_id: int) -> np.ndarray:
    out = np.empty(store.entry_info(layer, tensor_id).nbytes, dtype=np.uint8)
    store.restore(layer, tensor_id, out)
    return out


def on_device(store, keys) -> set:
    return {key for key in keys if store.entry_info(*key).on_device}


def names(message: str, *values) -> bool:
    """Whether the message names every value as a whole word (so "96" does not match "960")."""
    return all(re.search(rf"(?<![\d\w]){re.escape(str(v))}(?![\d\w])", message) for v in values)


# ---------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("tier", ["device", "host", "auto"])
@pytest.mark.parametrize("nbytes", [1, 7, 64, 1000, 4096])
def test_save_restore_round_trips_byte_for_byte(make_store, tier, nbytes):
    rng = np.random.default_rng(nbytes)
    store = make_store(device_limit=8192, strategy="every:2")
    for layer in (0, 1):  # every:2: layer 0 is a checkpoint (auto -> device), layer 1 is not
        data = random_bytes(rng, nbytes)
        store.save(layer, 3, data, tier=tier)
        np.testing.assert_array_equal(restored(store, layer, 3), data)
        info = store.entry_info(layer, 3)
        expect_device = tier == "device" or (tier == "auto" and layer == 0)
        assert (info.nbytes, info.on_device, info.on_host) == (nbytes, expect_device, not expect_device)


def test_save_takes_typed_arrays_and_bytes_like_buffers(make_store):
    store = make_store()
    floats = np.arange(12, dtype=np.float32).reshape(3, 4)
    store.save(0, 0, floats)
    out = np.empty_like(floats)
    store.restore(0, 0, out)
    np.testing.assert_array_equal(out, floats)
    for tensor_id, buffer in enumerate([b"pebbles", bytearray(b"pebbles"), memoryview(b"pebbles")], 1):
        store.save(0, tensor_id, buffer, tier=TIER_HOST)
        out = bytearray(7)
        store.restore(0, tensor_id, out)
        assert out == b"pebbles"


def test_entry_keeps_its_type_and_shape(make_store):
    store = make_store()
    store.save(0, 0, np.zeros((3, 4), dtype=np.float32))
    assert store.entry_info(0, 0) == EntryInfo(48, -1, (4, 3), True, False)  # GGUF order: innermost first
    store.save(0, 1, np.zeros(144, dtype=np.uint8), desc=TensorDesc(12, (256, 1)), tier="host")
    assert store.entry_info(0, 1) == EntryInfo(144, 12, (256, 1), False, True)
    store.save(0, 2, b"abc")
    assert store.entry_info(0, 2) == EntryInfo(3, -1, (3,), True, False)


def test_read_and_write_ranges_round_trip(make_store):
    rng = np.random.default_rng(1)
    store = make_store(device_limit=4096)
    for tier, tensor_id in ((TIER_DEVICE, 0), (TIER_HOST, 1)):
        expected = random_bytes(rng, 1000)
        store.save(2, tensor_id, expected, tier=tier)
        for offset, nbytes in [(0, 1), (0, 1000), (999, 1), (123, 456), (500, 500)]:
            out = np.empty(nbytes, dtype=np.uint8)
            store.read(2, tensor_id, offset, out)
            np.testing.assert_array_equal(out, expected[offset:offset + nbytes])
            patch = random_bytes(rng, nbytes)
            store.write(2, tensor_id, offset, patch)
            expected[offset:offset + nbytes] = patch
            np.testing.assert_array_equal(restored(store, 2, tensor_id), expected)


def test_write_updates_every_copy(make_store):
    rng = np.random.default_rng(2)
    store = make_store(device_limit=256)
    expected = random_bytes(rng, 128)
    store.save(1, 0, expected, tier=TIER_HOST)
    store.prefetch(1)
    info = store.entry_info(1, 0)
    assert info.on_device and info.on_host
    patch = random_bytes(rng, 32)
    store.write(1, 0, 40, patch)
    expected[40:72] = patch
    np.testing.assert_array_equal(restored(store, 1, 0), expected)  # from the device copy
    store.save(2, 0, random_bytes(rng, 256), tier=TIER_DEVICE)      # evicts the device copy
    assert store.entry_info(1, 0) == EntryInfo(128, -1, (128,), False, True)
    np.testing.assert_array_equal(restored(store, 1, 0), expected)  # from the host copy


def test_saving_again_replaces_the_entry(make_store):
    store = make_store(device_limit=256)
    store.save(0, 0, np.full(100, 1, np.uint8), tier=TIER_DEVICE)
    store.save(0, 0, np.full(40, 2, np.uint8), tier=TIER_HOST)
    assert store.entry_info(0, 0) == EntryInfo(40, -1, (40,), False, True)
    np.testing.assert_array_equal(restored(store, 0, 0), np.full(40, 2, np.uint8))
    stats = store.stats()
    assert (stats.entries, stats.device_bytes, stats.host_bytes) == (1, 0, 40)


def test_erase_removes_the_entry_from_both_tiers(make_store):
    store = make_store(device_limit=256)
    store.save(3, 1, np.zeros(100, np.uint8), tier=TIER_HOST)
    store.prefetch(3)
    store.erase(3, 1)
    with pytest.raises(UnknownEntryError):
        store.entry_info(3, 1)
    stats = store.stats()
    assert (stats.entries, stats.device_bytes, stats.host_bytes) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------------
# tiers: eviction, prefetch, the limit


def test_eviction_follows_least_recently_used_order(make_store):
    store = make_store(device_limit=4 * 64, n_layers=8)
    keys = [(layer, 0) for layer in range(8)]
    block = np.zeros(64, np.uint8)
    for key in keys[:4]:
        store.save(*key, block, tier=TIER_DEVICE)          # order: 0 1 2 3
    store.restore(*keys[0], np.empty(64, np.uint8))         # 1 2 3 0
    store.save(*keys[4], block, tier=TIER_DEVICE)           # evicts 1 -> 2 3 0 4
    assert on_device(store, keys[:5]) == {keys[0], keys[2], keys[3], keys[4]}
    store.read(*keys[2], 10, np.empty(5, np.uint8))         # 3 0 4 2
    store.save(*keys[5], block, tier=TIER_DEVICE)           # evicts 3 -> 0 4 2 5
    assert on_device(store, keys[:6]) == {keys[0], keys[2], keys[4], keys[5]}
    store.write(*keys[0], 0, b"x")                          # 4 2 5 0
    store.save(*keys[6], np.zeros(128, np.uint8), tier=TIER_DEVICE)  # evicts 4 and 2 -> 5 0 6
    assert on_device(store, keys[:7]) == {keys[0], keys[5], keys[6]}
    store.save(*keys[5], block, tier=TIER_DEVICE)           # replacing an entry evicts no other
    assert on_device(store, keys[:7]) == {keys[0], keys[5], keys[6]}
    evicted = {keys[1], keys[2], keys[3], keys[4]}
    assert all(store.entry_info(*key).on_host for key in evicted)
    assert store.stats().evictions == 4


def test_evicted_entries_restore_intact_from_the_host_tier(make_store):
    rng = np.random.default_rng(3)
    store = make_store(device_limit=256, n_layers=4)
    saved = {}
    for i in range(20):
        key = (i % 4, i // 4)
        saved[key] = random_bytes(rng, 64)
        store.save(*key, saved[key], tier=TIER_DEVICE)
    stats = store.stats()
    assert (stats.entries, stats.device_bytes, stats.host_bytes, stats.evictions) == (20, 256, 16 * 64, 16)
    for key, data in saved.items():
        np.testing.assert_array_equal(restored(store, *key), data)


def test_prefetch_copies_host_only_entries_of_the_layer(make_store):
    store = make_store(device_limit=256, n_layers=4)
    store.save(0, 0, np.zeros(128, np.uint8), tier=TIER_DEVICE)   # another layer, least recently used
    store.save(0, 1, np.zeros(64, np.uint8), tier=TIER_DEVICE)
    for tensor_id, nbytes in ((0, 64), (1, 64), (2, 300)):        # 300: larger than the whole limit
        store.save(1, tensor_id, np.full(nbytes, tensor_id, np.uint8), tier=TIER_HOST)
    store.reset_stats()
    store.prefetch(1)
    assert store.entry_info(1, 0).on_device and store.entry_info(1, 1).on_device
    assert store.entry_info(1, 0).on_host, "prefetch keeps the host copy"
    assert store.entry_info(1, 2) == EntryInfo(300, -1, (300,), False, True)
    assert not store.entry_info(0, 0).on_device and store.entry_info(0, 1).on_device
    stats = store.stats()
    assert (stats.prefetches, stats.evictions, stats.bytes_h2d, stats.bytes_d2h) == (2, 1, 128, 128)
    assert stats.device_bytes == 192
    store.prefetch(1)                                             # nothing left to copy
    assert store.stats().prefetches == 2


def test_prefetch_never_evicts_entries_of_the_same_layer(make_store):
    store = make_store(device_limit=128, n_layers=4)
    store.save(1, 0, np.zeros(64, np.uint8), tier=TIER_DEVICE)
    store.save(1, 1, np.zeros(64, np.uint8), tier=TIER_HOST)
    store.save(1, 2, np.zeros(64, np.uint8), tier=TIER_HOST)
    store.prefetch(1)  # room for tensor 1 only, by ascending tensor id
    assert on_device(store, [(1, 0), (1, 1), (1, 2)]) == {(1, 0), (1, 1)}
    assert store.stats().evictions == 0


def test_prefetch_that_cannot_fit_evicts_nothing(make_store):
    store = make_store(device_limit=128, n_layers=4)
    store.save(1, 0, np.zeros(64, np.uint8), tier=TIER_DEVICE)
    store.save(0, 0, np.zeros(64, np.uint8), tier=TIER_DEVICE)
    store.save(1, 1, np.zeros(128, np.uint8), tier=TIER_HOST)  # cannot fit beside (1, 0)
    store.prefetch(1)
    assert on_device(store, [(0, 0), (1, 0), (1, 1)]) == {(0, 0), (1, 0)}
    assert store.stats().evictions == 0


def test_evicting_a_prefetched_entry_copies_nothing(make_store):
    store = make_store(device_limit=64, n_layers=4)
    store.save(1, 0, np.zeros(64, np.uint8), tier=TIER_HOST)
    store.prefetch(1)
    before = store.stats()
    store.save(2, 0, np.zeros(64, np.uint8), tier=TIER_DEVICE)
    after = store.stats()
    assert after.evictions - before.evictions == 1
    assert after.bytes_d2h == before.bytes_d2h, "the host copy was already there"
    assert after.host_bytes == before.host_bytes


def test_the_device_tier_counts_a_copy_as_the_device_holds_it(make_store, store_backend):
    """cuda: a copy of half a 2 MiB page or more in whole pages, as the driver backs it (pebble.h,
    PEBBLE_DEVICE_PAGE_BYTES: 11-27, on an H200, 32 layers of Llama-3-8B Q4_K_M held 200.5 MiB past their
    bytes), the limit in the same bytes; host and stub count bytes."""
    page = 2 << 20
    n = page // 2 + 1
    held = page if store_backend == "cuda" else n
    store = make_store(device_limit=3 * page, n_layers=2)
    store.save(0, 0, np.zeros(n, np.uint8), tier=TIER_DEVICE)
    store.save(0, 1, np.zeros(1000, np.uint8), tier=TIER_DEVICE)  # small: its bytes on every backend
    assert store.stats().device_bytes == held + 1000 == store.stats().device_peak_bytes
    assert backend_named(store_backend).device_footprint(n) == held
    store.save(1, 0, np.zeros(n, np.uint8), tier=TIER_DEVICE)  # the limit holds two pages and 1000 bytes
    assert store.stats().device_bytes == 2 * held + 1000
    store.save(1, 1, np.zeros(n, np.uint8), tier=TIER_DEVICE)  # a third page evicts on cuda, not in bytes
    assert store.stats().evictions == (1 if store_backend == "cuda" else 0)
    assert store.stats().device_bytes <= store.stats().device_limit_bytes
    if store_backend == "cuda":
        small = make_store(device_limit=n + 10, n_layers=1)
        with pytest.raises(TooLargeError, match="on the device"):
            small.save(0, 0, np.zeros(n, np.uint8), tier=TIER_DEVICE)


def check_accounting(store, model: dict) -> None:
    """The stats agree with the entries: bytes per tier, entry count, the limit, no entry copyless."""
    stats = store.stats()
    infos = {key: store.entry_info(*key) for key in model}
    assert stats.device_bytes <= stats.device_limit_bytes
    assert stats.device_peak_bytes <= stats.device_limit_bytes
    assert stats.entries == len(model)
    held = backend_named(store.backend).device_footprint  # an entry as the device holds it (cuda: in pages)
    assert stats.device_bytes == sum(held(i.nbytes) for i in infos.values() if i.on_device)
    assert stats.host_bytes == sum(i.nbytes for i in infos.values() if i.on_host)
    assert all(i.on_device or i.on_host for i in infos.values()), "an entry lost every copy"
    assert all(i.nbytes == len(model[key]) for key, i in infos.items())


def test_device_bytes_stay_within_the_limit_through_random_operations(make_store):
    rng = np.random.default_rng(4)
    limit, n_layers = 512, 4
    store = make_store(device_limit=limit, n_layers=n_layers, strategy="every:2")
    model: dict[tuple[int, int], np.ndarray] = {}
    for step in range(300):
        op = rng.choice(["save", "save", "restore", "read", "write", "erase", "prefetch"])
        key = (int(rng.integers(n_layers)), int(rng.integers(4)))
        if op == "save":
            nbytes = int(rng.choice([1, 17, 64, 200, 300, limit + 1]))
            tier = str(rng.choice(["auto", "device", "host"]))
            data = random_bytes(rng, nbytes)
            bound_for_device = tier == "device" or (tier == "auto" and key[0] % 2 == 0)
            if bound_for_device and nbytes > limit:
                with pytest.raises(TooLargeError):
                    store.save(*key, data, tier=tier)
            else:
                store.save(*key, data, tier=tier)
                model[key] = data
        elif op == "prefetch":
            store.prefetch(key[0])
        elif key not in model:
            with pytest.raises(UnknownEntryError):
                store.entry_info(*key)
        elif op == "restore":
            np.testing.assert_array_equal(restored(store, *key), model[key])
        elif op in ("read", "write"):
            offset = int(rng.integers(len(model[key])))
            nbytes = int(rng.integers(1, len(model[key]) - offset + 1))
            if op == "read":
                out = np.empty(nbytes, np.uint8)
                store.read(*key, offset, out)
                np.testing.assert_array_equal(out, model[key][offset:offset + nbytes])
            else:
                patch = random_bytes(rng, nbytes)
                store.write(*key, offset, patch)
                model[key][offset:offset + nbytes] = patch
        else:
            store.erase(*key)
            del model[key]
        check_accounting(store, model)
    for key, data in model.items():
        np.testing.assert_array_equal(restored(store, *key), data)


# ---------------------------------------------------------------------------------------------------
# strategies


def evenly_spaced(resident: list[int], n_layers: int) -> bool:
    """Layer 0 first and every gap between neighbouring resident layers (cyclically) within one of L/k."""
    k = len(resident)
    if k == 0:
        return True
    gaps = [(b - a) % n_layers or n_layers for a, b in zip(resident, resident[1:] + resident[:1])]
    return resident[0] == 0 and all(n_layers // k <= g <= -(-n_layers // k) for g in gaps)


def expected_resident(text: str, arg: int, n_layers: int) -> list[int] | None:
    """Independent expectations from DESIGN.md's table; None where only count and spacing are fixed."""
    if text == "none":
        return list(range(n_layers))
    if text == "minimal":
        return []
    if text.startswith("every:"):
        n = int(text.split(":")[1])
        return [i for i in range(n_layers) if i % n == 0]
    return None


def strategy_cases():
    for n_layers in (1, 2, 7, 32, 80):
        for k in sorted({0, 1, n_layers // 2, n_layers}):
            yield n_layers, "adaptive", k
        for text in ("none", "sqrt", "minimal", "every:1", "every:2", "every:3", "every:8"):
            yield n_layers, text, 0


@pytest.mark.parametrize("n_layers,text,arg", list(strategy_cases()),
                         ids=[f"L{n}-{t}{a if t == 'adaptive' else ''}" for n, t, a in strategy_cases()])
def test_should_checkpoint_follows_the_strategy_table(make_store, n_layers, text, arg):
    strategy = Strategy("adaptive", strategies.ADAPTIVE, arg) if text == "adaptive" else Strategy.parse(text)
    store = make_store(n_layers=n_layers, strategy=strategy)
    resident = [i for i in range(n_layers) if store.should_checkpoint(i)]
    assert resident == strategies.resident_layers(strategy.code, strategy.arg, n_layers)
    expected = expected_resident(text, arg, n_layers)
    if expected is not None:
        assert resident == expected
    else:
        k = math.ceil(math.sqrt(n_layers)) if text == "sqrt" else arg
        assert len(resident) == k
        assert evenly_spaced(resident, n_layers)
        if 2 * k >= n_layers:  # every streamed layer sits between resident ones, so transfers overlap
            streamed = set(range(n_layers)) - set(resident)
            assert not any(i + 1 in streamed for i in streamed)
    with pytest.raises(LayerRangeError):
        store.should_checkpoint(n_layers)


def test_auto_tier_places_checkpoint_layers_on_the_device(make_store):
    store = make_store(n_layers=7, strategy="sqrt")
    for layer in range(7):
        store.save(layer, 0, b"pebble", tier=TIER_AUTO)
        assert store.entry_info(layer, 0).on_device == store.should_checkpoint(layer)


@pytest.mark.parametrize("strategy,n_layers,error,named", [
    (Strategy("every:0", strategies.EVERY, 0), 4, StrategyError, [0]),
    (Strategy("adaptive", strategies.ADAPTIVE, 5), 4, StrategyError, [5]),
    (Strategy("adaptive", strategies.ADAPTIVE, -1), 4, StrategyError, [-1]),
    (Strategy("bogus", 9, 0), 4, StrategyError, [9]),
    ("every:0", 4, StrategyError, ["every:0"]),
    ("sideways", 4, StrategyError, ["sideways"]),
    ("none", 0, InvalidArgumentError, [0]),
], ids=["every0", "adaptive-over", "adaptive-negative", "unknown-code", "every0-text", "unknown-name",
        "no-layers"])
def test_bad_strategy_at_open_raises(store_backend, strategy, n_layers, error, named):
    with pytest.raises(error) as caught:
        open_store(1024, n_layers, strategy, backend=store_backend)
    assert names(str(caught.value), *named), str(caught.value)


def test_set_strategy_moves_residency_without_saving_again(make_store):
    rng = np.random.default_rng(6)
    store = make_store(device_limit=1024, n_layers=4, strategy="none")
    saved = {(layer, 0): random_bytes(rng, 64) for layer in range(4)}
    for key, data in saved.items():
        store.save(*key, data)
    store.set_strategy("every:2")
    assert str(store.strategy) == "every:2"
    assert [store.should_checkpoint(i) for i in range(4)] == [True, False, True, False]
    assert on_device(store, saved) == {(0, 0), (2, 0)}
    assert store.entry_info(1, 0).on_host and store.entry_info(3, 0).on_host
    store.set_strategy("none")  # streamed layers come back from the host tier
    assert on_device(store, saved) == set(saved)
    stats = store.stats()
    assert (stats.saves, stats.evictions, stats.prefetches) == (4, 2, 2)
    for key, data in saved.items():
        np.testing.assert_array_equal(restored(store, *key), data)


def test_set_strategy_with_a_new_limit_evicts_and_fills_in_order(make_store):
    store = make_store(device_limit=256, n_layers=4, strategy="none")
    keys = [(layer, 0) for layer in range(4)]
    for key in keys:
        store.save(*key, np.zeros(64, np.uint8))
    store.restore(0, 0, np.empty(64, np.uint8))  # least recently used now: layer 1, then 2
    store.set_strategy("none", device_limit=128)
    assert on_device(store, keys) == {(3, 0), (0, 0)}
    assert (store.device_limit, store.stats().device_limit_bytes) == (128, 128)
    with pytest.raises(TooLargeError):
        store.save(0, 1, np.zeros(200, np.uint8), tier=TIER_DEVICE)
    store.set_strategy("none", device_limit=192)  # room for one more: ascending layer fills first
    assert on_device(store, keys) == {(0, 0), (1, 0), (3, 0)}
    assert store.stats().device_bytes == 192


def test_an_entry_kept_on_host_stays_there_whatever_the_strategy(make_store):
    """keep_on_host: its device copy moves to the host tier at once; set_strategy, prefetch and an automatic
    save leave it there (the layer's other entries placed as before); keep False gives it back to the strategy."""
    rng = np.random.default_rng(8)
    store = make_store(device_limit=1024, n_layers=2, strategy="none")
    saved = {(layer, t): random_bytes(rng, 64) for layer in range(2) for t in range(2)}
    for key, data in saved.items():
        store.save(*key, data)
    store.keep_on_host(0, 1)
    assert on_device(store, saved) == {(0, 0), (1, 0), (1, 1)}
    assert store.stats().evictions == 1
    store.set_strategy("minimal")
    store.set_strategy("none")
    store.prefetch(0)
    store.save(0, 1, saved[0, 1])                # the automatic tier of a resident layer
    store.save(0, 1, random_bytes(rng, 32))      # another size: still kept
    assert on_device(store, saved) == {(0, 0), (1, 0), (1, 1)}
    store.save(0, 1, saved[0, 1], tier=TIER_DEVICE)  # asked for by name: placed there
    assert (0, 1) in on_device(store, saved)
    store.keep_on_host(0, 1, False)
    store.set_strategy("none")
    assert on_device(store, saved) == set(saved)
    store.keep_on_host(0, 1)
    np.testing.assert_array_equal(restored(store, 0, 1), saved[0, 1])
    with pytest.raises(UnknownEntryError):
        store.keep_on_host(1, 7)
    with pytest.raises(LayerRangeError):
        store.keep_on_host(2, 0)


def test_set_strategy_refuses_a_bad_strategy_and_changes_nothing(make_store):
    store = make_store(device_limit=256, n_layers=4, strategy="sqrt")
    store.save(0, 0, b"pebble")
    before = store.stats()
    with pytest.raises(StrategyError) as caught:
        store.set_strategy(Strategy("adaptive", strategies.ADAPTIVE, 9))
    assert names(str(caught.value), 9)
    assert (str(store.strategy), store.stats()) == ("sqrt", before)
    assert [store.should_checkpoint(i) for i in range(4)] == [True, False, True, False]


# ---------------------------------------------------------------------------------------------------
# errors: each its own class, a message naming layer and sizes, and the store still usable


class FakeCudaArray:
    """Looks like device memory to a store (never dereferenced: host backends must refuse it)."""
    __cuda_array_interface__ = {"shape": (8,), "typestr": "|u1", "data": (0x1000, False), "version": 3}


def error_case(case_id: str, call, error, named=()):
    """call: what to do to the store the test sets up; named: values the message must name."""
    return pytest.param(call, error, named, id=case_id)


def u8(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


Invalid = InvalidArgumentError
ERROR_CASES = [
    error_case("unknown-entry", lambda s: s.restore(2, 7, u8(96)), UnknownEntryError, [2, 7]),
    error_case("erase-unknown", lambda s: s.erase(2, 7), UnknownEntryError, [2, 7]),
    error_case("info-unknown", lambda s: s.entry_info(2, 7), UnknownEntryError, [2, 7]),
    error_case("restore-size", lambda s: s.restore(1, 0, u8(64)), SizeMismatchError, [1, 96, 64]),
    error_case("read-past-end", lambda s: s.read(1, 0, 90, u8(16)), SizeMismatchError, [1, 96]),
    error_case("write-past-end", lambda s: s.write(3, 0, 95, b"ab"), SizeMismatchError, [3, 96]),
    error_case("restore-layer", lambda s: s.restore(9, 0, u8(96)), LayerRangeError, [9]),
    error_case("save-layer", lambda s: s.save(-1, 0, b"x"), LayerRangeError, [-1]),
    error_case("prefetch-layer", lambda s: s.prefetch(4), LayerRangeError, [4]),
    error_case("too-large", lambda s: s.save(1, 0, u8(2000), tier="device"), TooLargeError, [1, 2000, 1024]),
    error_case("too-large-auto", lambda s: s.save(2, 0, u8(2000)), TooLargeError, [2, 2000, 1024]),
    error_case("save-zero-bytes", lambda s: s.save(1, 0, b""), Invalid, [1]),
    error_case("save-negative-id", lambda s: s.save(1, -3, b"x"), Invalid, [-3]),
    error_case("save-bad-tier", lambda s: s.save(1, 0, b"x", tier=7), Invalid, [7]),
    error_case("save-tier-name", lambda s: s.save(1, 0, b"x", tier="sideways"), Invalid, ["sideways"]),
    error_case("save-no-dims", lambda s: s.save(1, 0, b"x", desc=TensorDesc(0, ())), Invalid, [1]),
    error_case("save-unknown-type", lambda s: s.save(1, 0, b"x", desc=TensorDesc(999, (1,))), Invalid, [999]),
    # a desc whose shape is not its bytes (once kept as given), and negative shapes
    error_case("save-f32-shape-not-bytes", lambda s: s.save(1, 0, u8(16), desc=TensorDesc(0, (8,))),
               SizeMismatchError, [16, 32, "F32", "[8]"]),
    error_case("save-q8_0-33-columns", lambda s: s.save(1, 0, u8(68), desc=TensorDesc(8, (33, 2))),
               SizeMismatchError, ["Q8_0", "[33, 2]", 32]),
    error_case("save-q8_0-17-elements", lambda s: s.save(1, 0, u8(34), desc=TensorDesc(8, (17,))),
               SizeMismatchError, ["Q8_0", "[17]", 32]),
    error_case("save-q4_k-blocks-not-bytes", lambda s: s.save(1, 0, u8(145), desc=TensorDesc(12, (256, 1))),
               SizeMismatchError, [145, 144, "Q4_K"]),
    error_case("save-zero-dimension", lambda s: s.save(1, 0, u8(16), desc=TensorDesc(0, (4, 0))),
               SizeMismatchError, [16, 0, "[4, 0]"]),
    error_case("save-bytes-shape-not-bytes", lambda s: s.save(1, 0, u8(16), desc=TensorDesc(-1, (3,))),
               SizeMismatchError, [16, "[3]"]),
    error_case("save-negative-shape", lambda s: s.save(1, 0, u8(32), desc=TensorDesc(0, (-4, -2))), Invalid,
               ["[-4, -2]"]),
    error_case("borrowed-shape-not-bytes", lambda s: s.save_borrowed(1, 0, u8(16), desc=TensorDesc(1, (16,))),
               SizeMismatchError, [16, 32, "F16"]),
    error_case("host-view-negative-shape", lambda s: s.host_array(3, 0, np.float32, (-4, -6)), Invalid, [-4, -6]),
    error_case("device-view-negative-shape", lambda s: s.device_array(1, 0, np.float32, (-6, -4)), Invalid,
               [-4, -6]),
    error_case("restore-negative-id", lambda s: s.restore(1, -3, u8(96)), Invalid, [-3]),
    error_case("read-zero-bytes", lambda s: s.read(1, 0, 0, u8(0)), Invalid, [1]),
    error_case("restore-zero-bytes", lambda s: s.restore(1, 0, u8(0)), Invalid, [1]),
    error_case("read-negative-offset", lambda s: s.read(1, 0, -1, u8(4)), Invalid, [-1]),
    error_case("non-contiguous", lambda s: s.save(1, 0, np.zeros((8, 8), np.uint8)[:, ::2]), Invalid),
    error_case("read-only-out", lambda s: s.restore(1, 0, bytes(96)), Invalid),
    error_case("bad-stream", lambda s: s.restore(1, 0, u8(96), stream="fast"), Invalid),
]


@pytest.mark.parametrize("call,error,named", ERROR_CASES)
def test_each_error_raises_its_class_and_leaves_the_store_usable(make_store, call, error, named):
    store = make_store(device_limit=1024, n_layers=4, strategy="every:2")
    original = np.arange(96, dtype=np.uint8)
    store.save(1, 0, original, tier=TIER_DEVICE)
    store.save(3, 0, original, tier=TIER_HOST)
    before = store.stats()
    with pytest.raises(error) as caught:
        call(store)
    assert names(str(caught.value), *named), str(caught.value)
    assert store.stats() == before, "a failed call changed the store"
    np.testing.assert_array_equal(restored(store, 1, 0), original)
    store.save(0, 5, b"still works")
    assert bytes(restored(store, 0, 5)) == b"still works"


@pytest.mark.parametrize("store_backend", store_backend_params(("host", "stub")))  # cuda takes them
def test_host_memory_backends_refuse_device_arrays(store_backend, make_store):
    store = make_store()
    with pytest.raises(InvalidArgumentError):
        store.save(0, 0, FakeCudaArray())


def test_every_call_on_a_closed_store_raises_closed_error(make_store):
    store = make_store()
    store.save(0, 0, b"pebble")
    store.close()
    store.close()  # idempotent
    out = bytearray(6)
    calls = [
        lambda: store.save(0, 1, b"x"), lambda: store.restore(0, 0, out), lambda: store.read(0, 0, 0, out),
        lambda: store.write(0, 0, 0, b"x"), lambda: store.erase(0, 0), lambda: store.prefetch(0),
        lambda: store.entry_info(0, 0), lambda: store.should_checkpoint(0),
        lambda: store.set_strategy("none"), store.stats, store.reset_stats, store.synchronize,
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()
    assert store.closed


def test_context_manager_closes_the_store(store_backend):
    with open_store(1024, 2, "none", backend=store_backend) as store:
        store.save(0, 0, b"pebble")
    with pytest.raises(ClosedError):
        store.stats()


# ---------------------------------------------------------------------------------------------------
# threads


def test_threads_sharing_one_store_keep_every_entry_intact(make_store):
    n_threads, ops, n_layers = 8, 1000, 4
    store = make_store(device_limit=2048, n_layers=n_layers)
    shared = {(layer, 1000): np.full(100, layer, np.uint8) for layer in range(n_layers)}
    for key, data in shared.items():
        store.save(*key, data, tier=TIER_HOST)
    failures, counts = [], []

    def worker(index: int) -> None:
        rng = np.random.default_rng(100 + index)
        layer = index % n_layers
        mine: dict[tuple[int, int], np.ndarray] = {}
        saves = reads = 0
        try:
            for _ in range(ops):
                key = (layer, index * 4 + int(rng.integers(4)))
                op = rng.integers(6)
                if op == 0 or key not in mine:
                    mine[key] = random_bytes(rng, int(rng.integers(1, 200)))
                    store.save(*key, mine[key], tier=str(rng.choice(["device", "host"])))
                    saves += 1
                elif op == 1:
                    assert np.array_equal(restored(store, *key), mine[key]), f"thread {index} {key}"
                    reads += 1
                elif op == 2:
                    offset = int(rng.integers(len(mine[key])))
                    patch = random_bytes(rng, len(mine[key]) - offset)
                    store.write(*key, offset, patch)
                    mine[key][offset:] = patch
                elif op == 3:
                    shared_key = (int(rng.integers(n_layers)), 1000)
                    out = np.empty(50, np.uint8)
                    store.read(*shared_key, 25, out)
                    assert np.array_equal(out, shared[shared_key][25:75]), f"shared {shared_key}"
                    reads += 1
                elif op == 4:
                    store.prefetch(int(rng.integers(n_layers)))
                else:
                    assert store.stats().device_bytes <= 2048
            for key, data in mine.items():
                assert np.array_equal(restored(store, *key), data), f"thread {index} {key} at the end"
                reads += 1
            counts.append((saves, reads))
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    stats = store.stats()
    assert stats.saves == len(shared) + sum(s for s, _ in counts)
    assert stats.restores == sum(r for _, r in counts)
    assert stats.device_peak_bytes <= 2048


# ---------------------------------------------------------------------------------------------------
# stats


def test_stats_count_as_specified(make_store):
    store = make_store(device_limit=256, n_layers=4)
    d100 = np.zeros(100, np.uint8)
    store.save(0, 0, d100, tier=TIER_DEVICE)    # h2d 100
    store.save(1, 0, d100, tier=TIER_HOST)      # host to host: no bus bytes
    store.save(2, 0, d100, tier=TIER_DEVICE)    # h2d 100
    store.save(3, 0, d100, tier=TIER_DEVICE)    # evicts (0, 0): d2h 100; h2d 100
    store.restore(3, 0, np.empty(100, np.uint8))    # hit: d2h 100
    store.restore(0, 0, np.empty(100, np.uint8))    # miss: host to host
    store.read(1, 0, 10, np.empty(20, np.uint8))    # miss
    store.write(2, 0, 0, np.zeros(10, np.uint8))    # device copy: h2d 10
    store.prefetch(0)                               # evicts (3, 0): d2h 100; copies (0, 0): h2d 100
    store.save(1, 0, np.zeros(50, np.uint8), tier=TIER_DEVICE)  # replaces the host entry: h2d 50
    store.erase(2, 0)
    assert store.stats() == StoreStats(
        device_limit_bytes=256, device_bytes=150, device_peak_bytes=250, host_bytes=200, host_peak_bytes=300,
        entries=3, saves=5, restores=3, hits=1, evictions=2, prefetches=1, bytes_h2d=460, bytes_d2h=300,
        bytes_restored=220)
    store.reset_stats()
    assert store.stats() == StoreStats(
        device_limit_bytes=256, device_bytes=150, device_peak_bytes=150, host_bytes=200, host_peak_bytes=200,
        entries=3, saves=0, restores=0, hits=0, evictions=0, prefetches=0, bytes_h2d=0, bytes_d2h=0,
        bytes_restored=0)


def scripted_run(store, seed: int = 5) -> list:
    """A seeded mix of every call, recording stats and entry states after each."""
    rng = np.random.default_rng(seed)
    trace = []
    keys = [(layer, tensor_id) for layer in range(4) for tensor_id in range(3)]
    for _ in range(200):
        layer, tensor_id = keys[int(rng.integers(len(keys)))]
        op = int(rng.integers(8))
        try:
            if op <= 1:
                store.save(layer, tensor_id, random_bytes(rng, int(rng.choice([8, 64, 130, 300]))),
                           tier=int(rng.integers(3)))
            elif op == 2:
                store.restore(layer, tensor_id, np.empty(store.entry_info(layer, tensor_id).nbytes, np.uint8))
            elif op == 3:
                store.read(layer, tensor_id, 0, np.empty(8, np.uint8))
            elif op == 4:
                store.prefetch(layer)
            elif op == 5:
                store.write(layer, tensor_id, 4, random_bytes(rng, 4))
            elif op == 6 and rng.random() < 0.3:
                store.set_strategy(str(rng.choice(["none", "sqrt", "minimal", "every:3"])),
                                   device_limit=int(rng.choice([64, 256, 600])))
            else:
                store.erase(layer, tensor_id)
        except (UnknownEntryError, TooLargeError) as exc:
            trace.append(type(exc).__name__)
        infos = []
        for key in keys:
            try:
                infos.append(store.entry_info(*key))
            except UnknownEntryError:
                infos.append(None)
        trace.append((store.stats(), infos))
    return trace


def test_stub_and_native_backend_agree_step_by_step(store_backend):
    if store_backend == "stub":
        pytest.skip("compares a native backend with the stub")
    configs = [(limit, strategy) for limit in (100, 256, 600) for strategy in ("none", "every:2", "minimal")]
    for seed, (limit, strategy) in enumerate(configs):
        with open_store(limit, 4, strategy, backend="stub") as stub, \
             open_store(limit, 4, strategy, backend=store_backend) as native:
            for step, (want, got) in enumerate(zip(scripted_run(stub, seed), scripted_run(native, seed))):
                assert got == want, f"limit {limit}, {strategy}, seed {seed}: step {step}"


# ---------------------------------------------------------------------------------------------------
# device arrays (cuda backend)


@pytest.mark.parametrize("store_backend", store_backend_params(("cuda",)))
def test_cuda_backend_takes_cupy_arrays_and_streams(store_backend, make_store):
    cupy = pytest.importorskip("cupy")
    store = make_store(device_limit=1 << 20)
    stream = cupy.cuda.Stream(non_blocking=True)
    data = cupy.arange(4096, dtype=cupy.float32).reshape(64, 64)
    store.save(0, 0, data, tier=TIER_DEVICE, stream=stream)        # device to device: no bus bytes
    store.save(0, 1, data, tier=TIER_HOST, stream=stream)          # d2h
    out0, out1 = cupy.empty_like(data), cupy.empty_like(data)
    store.restore(0, 0, out0, stream=stream)                       # d2d
    store.restore(0, 1, out1, stream=stream)                       # h2d
    stream.synchronize()
    assert bool((out0 == data).all()) and bool((out1 == data).all())
    assert store.entry_info(0, 0).shape == (64, 64)
    stats = store.stats()
    assert (stats.bytes_h2d, stats.bytes_d2h, stats.hits) == (data.nbytes, data.nbytes, 1)
    host = np.empty(4096, np.float32)
    store.restore(0, 0, host)                                      # no stream: done on return
    np.testing.assert_array_equal(host, np.arange(4096, dtype=np.float32))


# ---------------------------------------------------------------------------------------------------
# backend selection (not per backend)


def test_an_invalid_backend_name_is_refused_naming_the_valid_ones(monkeypatch):
    monkeypatch.setenv("PEBBLING_BACKEND", "quantum")
    with pytest.raises(PebblingError, match="cuda, host, stub"):
        select_backend()


def test_the_stub_can_always_be_chosen(monkeypatch):
    monkeypatch.setenv("PEBBLING_BACKEND", "stub")
    choice = select_backend()
    assert (choice.name, choice.library_path) == ("stub", None)
    assert probe("stub").usable


def test_an_explicit_backend_that_cannot_load_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PEBBLING_LIB", str(tmp_path / "libpebble_missing.so"))
    with pytest.raises(PebblingError, match="libpebble_missing.so"):
        select_backend("host")


def to_host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


def test_device_array_views_a_resident_entry_in_place(make_store):
    store = make_store(device_limit=4096, n_layers=2)
    weights = np.arange(64, dtype=np.float32).reshape(8, 8)
    store.save(0, 3, weights, tier=TIER_DEVICE)
    view = store.device_array(0, 3, np.float32, (8, 8))
    assert np.array_equal(to_host(view), weights)
    view[2, 5] = -1.0  # writes land in the entry itself
    out = np.empty_like(weights)
    store.restore(0, 3, out)
    assert out[2, 5] == -1.0


def test_device_array_refuses_host_entries_and_wrong_shapes(make_store):
    store = make_store(device_limit=4096, n_layers=2)
    store.save(0, 0, np.zeros(16, np.float32), tier=TIER_DEVICE)
    store.save(1, 0, np.zeros(16, np.float32), tier=TIER_HOST)
    with pytest.raises(UnknownEntryError, match="layer 1 tensor 0"):
        store.device_array(1, 0, np.float32, (16,))
    with pytest.raises(SizeMismatchError, match="64 bytes"):
        store.device_array(0, 0, np.float32, (17,))
    assert store.device_array(0, 0, np.float16, (32,)).shape == (32,)


def test_the_overhead_is_the_most_measured_beyond_the_pool_and_every_open_tier(monkeypatch):
    """Backend.overhead_bytes: the process's CUDA context, libraries and kernels are counted once for every
    model, as NVML's figure less CuPy's pool and the device tier of each store still open (another model's
    weights are not this one's overhead), and never lowered (11-27 on the H200: two loads in one process
    measured a floor 1 MB apart, and a plan made later named a smaller footprint than one made before)."""
    from pyplugin.store import gpu
    from pyplugin.store.backend import HostBackend

    found = probe("host")
    assert found.usable, found.reason
    backend = HostBackend("host", found.library_path)  # a backend of its own: the process's is left as it is
    nvml = {"bytes": 10_000}
    monkeypatch.setattr(backend, "measures_memory", True)
    monkeypatch.setattr(backend, "used_memory", lambda: gpu.DeviceUse(nvml["bytes"], True))
    monkeypatch.setattr(backend, "pool_bytes", lambda: 1_000)
    one, two = (backend.open_store(4096, 2, "none") for _ in range(2))
    one.save(0, 0, np.zeros(500, np.uint8), tier=TIER_DEVICE)
    two.save(0, 0, np.zeros(700, np.uint8), tier=TIER_DEVICE)
    assert backend.overhead_bytes() == 10_000 - 1_000 - 500 - 700
    nvml["bytes"] = 9_000  # lower: a floor of the process's is never lowered
    assert backend.overhead_bytes() == 7_800
    nvml["bytes"] = 12_000
    assert backend.overhead_bytes() == 9_800
    two.close()  # its tier is given back: what NVML counts now is no longer less its bytes
    nvml["bytes"] = 11_300
    assert backend.overhead_bytes() == 11_300 - 1_000 - 500
    one.close()
    monkeypatch.setattr(backend, "measures_memory", False)
    assert backend.overhead_bytes() is None  # bytes are accounted, nothing measured

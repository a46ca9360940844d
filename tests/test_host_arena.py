"""The host library's weights in a huge-page arena (store/arena.py): the decode step reads the copy, not
the file's pages; PEBBLING_USE_MMAP=1 keeps the file's mapping; the tokens are the same either way."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import tiny_model
from pyplugin.model import QuantWeight
from pyplugin.model.gguf_file import drop_file_pages, file_map_of
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.store.arena import ALIGN, HostArena


def _tokens(pebbled: PebbledModel) -> list[int]:
    options = Options(temperature=0, num_predict=8, num_ctx=64)
    gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "none"}), 6)
    return list(gen.tokens([5, 17, 42, 8, 99, 3]))


def _in_file_map(array: np.ndarray) -> bool:
    return file_map_of(array) is not None


@pytest.mark.parametrize("use_mmap", [False, True])
def test_host_weights_are_copied_into_the_arena_unless_mmap_is_asked(monkeypatch, use_mmap):
    if use_mmap:
        monkeypatch.setenv("PEBBLING_USE_MMAP", "1")
    model = tiny_model("qwen2", weights="quantized")
    pebbled = PebbledModel(model, backend="host")
    borrowed = [a for a in pebbled.store._borrowed if isinstance(a, np.ndarray)]
    assert borrowed, "the host library computes from the bytes it was given"
    assert all(_in_file_map(a) == use_mmap for a in borrowed)
    if isinstance(pebbled.outer.output, QuantWeight):
        assert _in_file_map(pebbled.outer.output.data) == use_mmap


def test_weights_past_most_of_the_available_memory_stay_in_the_file(monkeypatch):
    import pyplugin.runtime.pebbled as pebbled_module
    from pyplugin.store.arena import fits

    assert fits(1 << 20) and not fits(1 << 60)
    monkeypatch.setattr(pebbled_module, "fits", lambda nbytes: False)
    pebbled = PebbledModel(tiny_model("qwen2", weights="quantized"), backend="host")
    borrowed = [a for a in pebbled.store._borrowed if isinstance(a, np.ndarray)]
    assert borrowed and all(_in_file_map(a) for a in borrowed)


def test_the_arena_gives_the_tokens_of_the_file_mapping(monkeypatch):
    arena = _tokens(PebbledModel(tiny_model("llama", weights="quantized"), backend="host"))
    monkeypatch.setenv("PEBBLING_USE_MMAP", "1")
    mapped = _tokens(PebbledModel(tiny_model("llama", weights="quantized"), backend="host"))
    assert arena == mapped


def test_arena_places_copies_aligned_and_refuses_what_does_not_fit():
    a = np.arange(10, dtype=np.uint8).reshape(2, 5)
    b = np.arange(6, dtype=np.float32).reshape(3, 2)
    arena = HostArena(HostArena.size_of([a, b]))
    pa, pb = arena.place(a), arena.place(b)
    np.testing.assert_array_equal(pa, a)
    np.testing.assert_array_equal(pb, b)
    assert pb.dtype == b.dtype and pb.shape == b.shape
    assert pb.__array_interface__["data"][0] % ALIGN == 0
    with pytest.raises(ValueError, match="do not fit"):
        arena.place(a)
    drop_file_pages(pb)  # an arena's pages are no file's: left as they are, not zeroed
    np.testing.assert_array_equal(pb, b)

"""A context shift of one sequence's KV entries in the store (model/kv_shift.py does the arithmetic): each
layer's held rows read out, shifted, and written back into the entries, wherever the plan placed them
(a resident layer's device views and a host backend's in-place views are those same bytes)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..model.kv_shift import shift_caches
from .layout import kv_ids


def shift_entries(layers: Any, seq: int, n_keep: int, n_discard: int, n_past: int) -> None:
    """Sequence `seq`'s K and V entries in every layer of `layers` (a StoreLayers) shifted: between
    passes, so nothing reads them meanwhile."""
    cfg, store = layers.pebbled.model.config, layers.store
    for i, shape in enumerate(layers.kv_shapes):
        if not cfg.owns_kv(i):  # a layer reading another's caches (Gemma 4) has none to shift
            continue
        held = min(n_past, shape[0])  # a ring holds its window's rows, all of them once it has wrapped
        pair = [np.empty((held, *shape[1:]), layers.kv_dtype) for _ in range(2)]
        for array, tensor_id in zip(pair, kv_ids(seq)):
            store.read(i, tensor_id, 0, array)
        shift_caches(cfg.for_layer(i), *pair, n_keep, n_discard, n_past)
        for array, tensor_id in zip(pair, kv_ids(seq)):
            store.write(i, tensor_id, 0, array)

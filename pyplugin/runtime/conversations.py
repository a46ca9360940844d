"""Idle conversations' KV caches, parked in host memory.

A batch's sequences each hold the conversation they last ran, so that its next turn prefills only what
is new. When a request takes a sequence that holds another conversation, that conversation is parked
rather than lost: its K and V rows (as many as its tokens; a sliding layer's ring, its window) are copied
into host memory. When it comes back, its rows are written into the sequence it takes, and it goes on
from there as if it had never left. (They are arrays of their own, not store entries: the store places a
resident layer's entries on the device, and these must never compete with the plan's for it.)

Restoring is always chosen over recomputing: bringing back a token costs its K and V rows, 2 × n_head_kv ×
head_dim values a layer, where recomputing it runs every weight of every layer over it. Parked
conversations are kept within a host-memory budget, the least recently parked dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .layout import kv_ids


@dataclass
class _Parked:
    tokens: list[int]
    n_ctx: int
    kv: str                                       # their KV type
    caches: list[tuple[np.ndarray, np.ndarray]]   # each layer's K and V rows
    nbytes: int


class ParkedConversations:
    """The conversations parked for one PebbledModel, within `budget` bytes of host memory."""

    def __init__(self, pebbled: Any, budget: int):
        self.pebbled, self.budget = pebbled, budget
        self._parked: OrderedDict[int, _Parked] = OrderedDict()  # by number, oldest first
        self._next = 0

    @property
    def held_bytes(self) -> int:
        return sum(p.nbytes for p in self._parked.values())

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, seq: int, tokens: Sequence[int], n_ctx: int, keep: int | None = None) -> bool:
        """Copies sequence `seq`'s K and V rows of `tokens` into host memory, dropping the least recently
        parked (but `keep`) to make room; False where the budget cannot hold them (nothing is kept)."""
        pebbled, store = self.pebbled, self.pebbled.store
        n_layers = pebbled.model.config.n_layer
        owns = pebbled.model.config.owns_kv  # a layer reading another's caches (Gemma 4) parks none
        rows = [min(len(tokens), pebbled.kv_shape(n_ctx, i)[0]) if owns(i) else 0 for i in range(n_layers)]
        nbytes = 2 * sum(n * int(np.prod(pebbled.kv_shape(n_ctx, i)[1:])) * pebbled.kv.dtype.itemsize
                         for i, n in enumerate(rows))
        kept = self._parked[keep].nbytes if keep in self._parked else 0
        if not tokens or kept + nbytes > self.budget:
            return False
        while self.held_bytes + nbytes > self.budget:
            del self._parked[next(k for k in self._parked if k != keep)]
        caches = []
        for i, n in enumerate(rows):
            pair = tuple(np.empty((n, *pebbled.kv_shape(n_ctx, i)[1:]), pebbled.kv.dtype) for _ in range(2))
            for source, held in zip(kv_ids(seq) if owns(i) else (), pair):
                store.read(i, source, 0, held)
            caches.append(pair if owns(i) else ())
        self._parked[self._next] = _Parked(list(tokens), n_ctx, pebbled.kv.name, caches, nbytes)
        self._next += 1
        return True

    def best(self, tokens: Sequence[int], n_ctx: int, kv: str) -> tuple[int | None, int]:
        """(the parked conversation whose tokens start `tokens` the furthest, how many), or (None, 0). As
        with a sequence's cache, the last token always runs again, and a conversation counts only where
        the request goes on from at least half of it."""
        best, length = None, 0
        for key, parked in self._parked.items():
            if parked.n_ctx != n_ctx or parked.kv != kv:
                continue
            n = 0
            for a, b in zip(parked.tokens, tokens[:len(tokens) - 1]):
                if a != b:
                    break
                n += 1
            if n > length and 2 * n >= len(parked.tokens):
                best, length = key, n
        return best, length

    def restore(self, key: int, seq: int) -> list[int]:
        """Writes the parked conversation `key` into sequence `seq`'s KV entries (which must exist) and
        forgets it; the tokens those entries now hold."""
        parked = self._parked.pop(key)
        for i, pair in enumerate(parked.caches):
            for target, held in zip(kv_ids(seq), pair):
                self.pebbled.store.write(i, target, 0, held)
        return parked.tokens

    def clear(self) -> None:
        self._parked.clear()

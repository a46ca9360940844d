"""The stub decoder's experts as pebbles: pebble_step_layer.experts_stored's semantics (native/pebble_decode.cu's
cached_expert), one layer's cache of experts restored from the store, the least recently used replaced."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError, SizeMismatchError
from ..ggml_types import row_bytes


class ExpertCache:
    """Layer `layer`'s experts, entry first_id + j of `store` for expert j (its gate rows, up rows, down rows
    in the types `types` gives), `slots` of them kept (0: one working buffer, every use restored)."""

    def __init__(self, kernels, store, layer: int, shape, types: dict, first_id: int, slots: int, stats: dict):
        where = f"pebble_decoder_create: layer {layer}"
        if store is None or shape.n_expert < 1 or first_id < 0 or not 0 <= slots <= shape.n_expert:
            raise InvalidArgumentError(f"{where}: experts stored need experts (n_expert {shape.n_expert}), the model's "
                                       f"store, expert_ids {first_id} at least 0 and expert_cache {slots} within "
                                       "0..n_expert")
        e, ff = shape.n_embd, shape.n_ff_exp
        self.parts = (("ffn_gate_exps", ff, e), ("ffn_up_exps", ff, e), ("ffn_down_exps", e, ff))
        self.sizes = [rows * row_bytes(types[name], cols) for name, rows, cols in self.parts]
        nbytes = sum(self.sizes)
        for j in range(shape.n_expert):
            try:
                held = store.entry_info(layer, first_id + j).nbytes
            except Exception:  # an unknown entry: the same refusal as a wrong size
                held = None
            if held != nbytes:
                raise SizeMismatchError(f"{where}: expert {j} (tensor {first_id + j}) is not an entry of {nbytes} "
                                        "bytes (its gate, up and down rows)")
        self.kernels, self.store, self.layer, self.types = kernels, store, layer, types
        self.first_id, self.keep, self.stats = first_id, slots, stats
        self.buffers = [np.zeros(nbytes, np.uint8) for _ in range(max(1, slots))]
        self.expert = [-1] * len(self.buffers)
        self.used = [0] * len(self.buffers)
        self.clock = 0

    def __call__(self, j: int) -> tuple:
        """Expert j's (gate, up, down) over a slot of the cache, restored first where it is not there."""
        self.clock += 1
        if self.keep and j in self.expert:
            k = self.expert.index(j)
            self.stats["expert_hits"] += 1
        else:
            k = self.expert.index(-1) if -1 in self.expert else min(range(len(self.used)), key=self.used.__getitem__)
            self.store.restore(self.layer, self.first_id + j, self.buffers[k])
            self.expert[k] = j
            self.stats["expert_misses"] += 1
            self.stats["expert_bytes_restored"] += self.buffers[k].nbytes
        self.used[k] = self.clock
        out, at = [], 0
        for (name, rows, cols), size in zip(self.parts, self.sizes):
            weights = {name: (self.types[name], self.buffers[k][at:at + size])}
            out.append(self.kernels._matrix(f"layer {self.layer}", weights, name, rows, cols))
            at += size
        return tuple(out)

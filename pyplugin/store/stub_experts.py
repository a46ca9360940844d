"""The stub decoder's experts as pebbles: pebble_step_model's expert slots with native/cuda/experts.cu's
semantics (place_experts, cached_expert, prefetch_experts): per layer a cache of experts restored from the
store, its victim the least recently or least often used, and staging slots shared by the layers for the
experts a step restores that no cache keeps, prefetched guesses among them."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError, SizeMismatchError
from ..ggml_types import row_bytes
from ..model.moe import router_probabilities
from ..model.transformer import router_input
from .abi import aligned


class _LayerCache:
    def __init__(self, shape, types: dict, first_id, slots: int):
        e, ff = shape.n_embd, shape.n_ff_exp
        self.parts = (("ffn_gate_exps", ff, e), ("ffn_up_exps", ff, e), ("ffn_down_exps", e, ff))
        self.sizes = [rows * row_bytes(types[name], cols) for name, rows, cols in self.parts]
        self.nbytes = sum(self.sizes)  # one expert: its gate, up and down rows
        self.shape, self.types, self.first_id = shape, types, first_id
        self.slot: list[np.ndarray] = []
        self.expert = [-1] * slots
        self.used = [0] * slots
        self.uses = [0] * shape.n_expert


class ExpertSlots:
    """The decoder's slots for the layers whose experts are pebbles of `store`: `layers` maps a layer to
    (its LayerShape, the types of its expert matrices, where its experts are, experts cached): the entry of
    its expert 0 (experts_stored 1: an entry per expert), or the entries of its merged gate, up and down
    tensors (experts_stored 2: expert j the j-th n_expert-th of each)."""

    def __init__(self, kernels, store, layers: dict, policy: int, prefetch: bool, stats: dict):
        fn = "pebble_decoder_create"
        if policy not in (0, 1) or prefetch not in (0, 1):
            raise InvalidArgumentError(f"{fn}: expert_policy {policy} must be 0 (least recently used) or 1 (least "
                                       f"often used), expert_prefetch {int(prefetch)} 0 or 1")
        self.kernels, self.store, self.policy, self.prefetching, self.stats = kernels, store, policy, prefetch, stats
        self.layers: dict[int, _LayerCache] = {}
        for i, (shape, types, first_id, slots) in layers.items():
            merged = isinstance(first_id, tuple)
            if store is None or shape.n_expert < 1 or (not merged and first_id < 0) or \
                    not 0 <= slots <= shape.n_expert:
                raise InvalidArgumentError(f"{fn}: layer {i}: experts_stored {2 if merged else 1} needs 0, or 1 or 2 "
                                           f"with experts (n_expert {shape.n_expert}), the model's store, (for 1) "
                                           f"expert_ids {first_id} at least 0 and expert_cache {slots} within "
                                           "0..n_expert")
            c = _LayerCache(shape, types, first_id, slots)

            def held(tensor_id):
                try:
                    return store.entry_info(i, tensor_id).nbytes
                except Exception:  # an unknown entry: the same refusal as a wrong size
                    return None
            for (name, _, _), size, tid in zip(c.parts, c.sizes, first_id if merged else (), strict=False):
                if held(tid) != size * shape.n_expert:
                    raise SizeMismatchError(f"{fn}: layer {i}: {name} (tensor {tid}) is not an entry of "
                                            f"{size * shape.n_expert} bytes ({shape.n_expert} experts of {size})")
            for j in range(0 if merged else shape.n_expert):
                if held(first_id + j) != c.nbytes:
                    raise SizeMismatchError(f"{fn}: layer {i}: expert {j} (tensor {first_id + j}) is not an entry of "
                                            f"{c.nbytes} bytes (its gate, up and down rows)")
            self.layers[i] = c
        if not self.layers:
            return
        self.slot_bytes = max(aligned(c.nbytes) for c in self.layers.values())
        most_used = max(c.shape.n_expert_used for c in self.layers.values())
        uncached = any(not c.expert for c in self.layers.values())
        n_staging = most_used if prefetch else 1 if uncached else 0
        for c in self.layers.values():
            c.slot = [np.zeros(self.slot_bytes, np.uint8) for _ in c.expert]
        self.staging = [[np.zeros(self.slot_bytes, np.uint8), -1, -1] for _ in range(n_staging)]  # slot, layer, expert
        stats["expert_device_bytes"] = self.slot_bytes * (sum(len(c.expert) for c in self.layers.values()) + n_staging)
        self.clock, self.guessed, self.to_run, self.running = 0, [], set(), None

    def __contains__(self, layer: int) -> bool:
        return layer in self.layers

    def for_layer(self, layer: int) -> "ExpertSlots":
        """moe_ffn's `experts` for `layer`'s routed FFN."""
        self.running = layer
        return self

    # -- moe_ffn's protocol: routed(the experts the step runs), then expert j for each, then done()

    def routed(self, experts) -> None:
        self.to_run = {int(j) for j in experts}
        self.stats["expert_guesses_right"] += sum(g in self.to_run for g in self.guessed)
        self.guessed = []

    def done(self) -> None:
        for g in self.staging:
            if g[1] == self.running:
                g[1] = g[2] = -1

    def __call__(self, j: int) -> tuple:
        """Expert j's (gate, up, down) over the slot the step runs it from (cached_expert)."""
        i, c = self.running, self.layers[self.running]
        self.clock += 1
        c.uses[j] += 1
        self.to_run.discard(j)
        if j in c.expert:
            k = c.expert.index(j)
            c.used[k] = self.clock
            self.stats["expert_hits"] += 1
            return self._views(c, c.slot[k])
        for g in self.staging:
            if g[1] == i and g[2] == j:
                self.stats["expert_hits"] += 1
                self.stats["expert_prefetch_hits"] += 1
                g[1] = g[2] = -1
                if not c.slot:
                    return self._views(c, g[0])
                v = self._victim(c)
                c.slot[v], g[0] = g[0], c.slot[v]
                c.expert[v], c.used[v] = j, self.clock
                return self._views(c, c.slot[v])
        if c.slot:
            v = self._victim(c)
            c.expert[v] = -1
            self._restore(i, j, c.slot[v])
            c.expert[v], c.used[v] = j, self.clock
            slot = c.slot[v]
        else:
            g = self.staging[self._staging_victim(i)]
            g[1] = g[2] = -1
            self._restore(i, j, g[0])
            slot = g[0]
        self.stats["expert_misses"] += 1
        return self._views(c, slot)

    # -- prefetch

    def prefetch(self, i: int, cfg, lw, x: np.ndarray, max_rows: int) -> None:
        """prefetch_experts: layer i's router on x [n, n_embd], the hidden state entering it, made its input as the
        layer makes it (transformer.router_input: normed with its ffn_norm, or Gemma 4's own); the n_expert_used
        experts of the highest probability summed over the tokens restored into staging slots where the layer's
        cache lacks them."""
        p = router_probabilities(cfg, router_input(cfg, x, lw), lw.ffn_gate_inp, max_rows, lw.ffn_gate_inp_b)
        score = np.zeros(p.shape[1], np.float32)
        for row in p:  # token by token, as the native step sums them
            score += row
        self.stage(i, np.argsort(-score, kind="stable")[:self.layers[i].shape.n_expert_used])

    def stage(self, i: int, guesses) -> None:
        """Layer i's guesses (at most n_expert_used): restored into staging slots where its cache lacks them."""
        c = self.layers[i]
        self.guessed = sorted(int(j) for j in guesses)
        for g in self.staging:
            g[1] = g[2] = -1
        free = iter(self.staging)
        for j in self.guessed:
            self.stats["expert_guesses"] += 1
            if j in c.expert:
                continue
            g = next(free)
            self._restore(i, j, g[0])
            g[1], g[2] = i, j
            self.stats["expert_prefetches"] += 1

    # -- slots

    def _victim(self, c: _LayerCache) -> int:
        """cache_victim: an empty slot, else of the experts not still to run (all, where every one is) the
        least recently used, or the least often run."""
        if -1 in c.expert:
            return c.expert.index(-1)
        if self.policy == 1:
            return min(range(len(c.expert)), key=lambda k: (c.expert[k] in self.to_run, c.uses[c.expert[k]], c.used[k]))
        return min(range(len(c.expert)), key=lambda k: (c.expert[k] in self.to_run, c.used[k]))

    def _staging_victim(self, i: int) -> int:
        pick, pick_expert = 0, -1
        for k, (_, layer, expert) in enumerate(self.staging):
            if layer != i or expert not in self.to_run:
                return k
            if expert > pick_expert:
                pick, pick_expert = k, expert
        return pick

    def _restore(self, i: int, j: int, slot: np.ndarray) -> None:
        c = self.layers[i]
        if isinstance(c.first_id, tuple):  # the j-th n_expert-th of each merged tensor, one after another
            at = 0
            for tensor_id, size in zip(c.first_id, c.sizes, strict=True):
                self.store.read(i, tensor_id, j * size, slot[at:at + size])
                at += size
        else:
            self.store.restore(i, c.first_id + j, slot[:c.nbytes])
        self.stats["expert_bytes_restored"] += c.nbytes

    def _views(self, c: _LayerCache, slot: np.ndarray) -> tuple:
        out, at = [], 0
        for (name, rows, cols), size in zip(c.parts, c.sizes):
            weights = {name: (c.types[name], slot[at:at + size])}
            out.append(self.kernels._matrix(f"layer {self.running}", weights, name, rows, cols))
            at += size
        return tuple(out)

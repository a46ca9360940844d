"""A plan run through a pebble store for a batch of sequences: the LayerSource that streams.

Resident layers are computed in place from the store's device tier; streamed layers are restored into
two working slots (the next one while the current one computes) and their new KV rows saved back.
Where the arrays are host memory (the host and stub backends) a streamed layer's weights are computed
from the host tier in place instead, so that streaming there costs no copy of them.
A forward pass runs one sequence's prefill chunk, or one decode token of each sequence of a batch: a
streamed layer's weights are restored once per pass, whatever the number of sequences in it, and each
sequence's KV cache (entries of its own, `layout.kv_ids`) comes along with it. The backend's device
operations order copies against compute (streams and events on the GPU, no-ops where a copy is done
when its call returns).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..model import LayerWeights
from ..kv_types import kv_type
from ..store import Decoder
from ..store.abi import aligned
from ..store.kernels import EXPERT_MATRICES
from . import experts
from .options import Options
from .context_shift import shift_entries
from .layout import bytes_of, kv_ids, ring_rows
from .plan import PebblingOptions, Plan
from .report import SequenceCost, pebbling_report

Array = Any


class StoreLayers:
    """A Plan run through the store for up to `plan.memory.n_seqs` sequences, each with KV entries of
    its own in every layer (sequence s: tensor ids `kv_ids(s)`).

    Streamed layers go through working slots: slot n % 2 receives the n-th streamed layer's weights and
    the KV rows 0..pos of every sequence in the pass while the layer before it computes; after it
    computes, the new KV rows are saved back. Where copies overlap compute (the GPU) they run on a stream
    of their own and events order them against compute, so no step waits for the whole device."""

    def __init__(self, pebbled: Any, plan: Plan, options: Options, pebbling: PebblingOptions):
        """`pebbled`: the PebbledModel whose store holds the layers."""
        self.pebbled, self.plan, self.pebbling = pebbled, plan, pebbling
        self.backend = backend = pebbled.backend
        self.store, self.xp, self.dtype, self.outer = pebbled.store, pebbled.xp, pebbled.dtype, pebbled.outer
        self.attend_kernels = pebbled.kernels if pebbled.kernels.attends else None
        self.n_ctx = options.num_ctx
        self.n_seqs = plan.memory.n_seqs
        self.n_layers = plan.memory.n_layers
        # Experts as pebbles: the layers' merged expert tensors stay in the host tier (runtime.experts); their
        # views there give the decoder their types, and on host memory a prefill computes from them in place.
        self.experts_apart = plan.expert_cache is not None
        self._expert_layers = set(experts.expert_layers(pebbled)) if self.experts_apart else set()
        self._prefill_slot = None
        # Per layer: a sliding-window layer's cache is a ring of its window's rows, in the request's KV type.
        self.kv = kv_type(options.kv_type)
        self.kv_fallback = options.kv_fallback  # why that is f16 and not the server's type, for the report
        self.kv_dtype = self.kv.dtype
        self.kv_shapes = [pebbled.kv_shape(self.n_ctx, i, self.kv) for i in range(len(pebbled.layouts))]
        self.row_bytes = [int(np.prod(shape[1:])) * self.kv_dtype.itemsize for shape in self.kv_shapes]  # per layer
        # Gemma 4: a layer reading another's caches (kv_source) computes over that layer's, resident (the plan
        # pins it), and keeps, restores and writes back none of its own
        self.kv_source = pebbled.model.config.kv_source
        pebbled.kernels.release_workspace()
        backend.free_pool()  # measure this plan, not the last
        pebbled.prepare(plan, self.n_ctx, self.kv)

        self.resident = {i: self._resident_weights(i) for i in plan.resident}
        self._resident_kv: dict[tuple[int, int], tuple[Array, Array]] = {}
        self.streamed = list(plan.streamed)
        self.order = {layer: n for n, layer in enumerate(self.streamed)}
        slot_bytes = max((self._slot_size(i) for i in self.streamed), default=0)
        self.slots = [self.xp.empty(slot_bytes, np.uint8) for _ in range(plan.n_slots)]
        self.slot_bytes = slot_bytes
        self.in_slot: list[tuple | None] = [None] * plan.n_slots  # (weights, [(k, v) per sequence])
        self._views: dict[tuple[int, int, int], tuple] = {}
        self.host_views: dict[int, LayerWeights] = {}  # streamed layers' weights in the host tier (host memory)
        self.host_kv: dict[tuple[int, int], tuple[Array, Array]] = {}  # ... and their KV caches, per sequence
        self.copy_stream = backend.copy_stream()
        self.ready = [backend.event() for _ in self.slots]     # a slot's layer is restored
        self.computed = [backend.event() for _ in self.slots]  # a slot's layer has computed
        self.peak_sample = 0
        self.costs: dict[int, SequenceCost] = {}
        self.pass_seqs: list[tuple[int, int, int]] = []   # (sequence, position, tokens) of the pass running
        self._pass_start = (0, 0)
        self._decoder: Decoder | None = None
        self._slots_user = "python"
        self._sample_memory()

    def sequence(self, seq: int) -> "SequenceLayers":
        """The LayerSource of sequence `seq` alone (its prefill, or decode steps of its own), its cost
        counted from here on."""
        if not 0 <= seq < self.n_seqs:
            raise ValueError(f"sequence {seq} is outside this plan's 0..{self.n_seqs - 1}")
        self.pebbled.ensure_kv(seq)
        self.costs[seq] = SequenceCost()
        return SequenceLayers(self, seq)

    # -- views

    def _apart(self, t) -> bool:
        """Whether tensor `t` of a layer is a merged expert tensor left in the host tier."""
        return self.experts_apart and t.name in EXPERT_MATRICES

    def _host_view(self, i: int, t) -> Any:
        return t.view(self.store.host_array(i, t.tensor_id, np.uint8, (t.nbytes,)), self.dtype, self.pebbled.kernels)

    def _resident_weights(self, i: int) -> LayerWeights:
        view, kernels = self.store.device_array, self.pebbled.kernels
        return LayerWeights(**{t.name: self._host_view(i, t) if self._apart(t) else
                               t.view(view(i, t.tensor_id, np.uint8, (t.nbytes,)), self.dtype, kernels)
                               for t in self.pebbled.layouts[i]})

    def _kv_bytes(self, i: int) -> int:
        return int(np.prod(self.kv_shapes[i])) * self.kv_dtype.itemsize

    def _slot_size(self, i: int) -> int:
        return sum(aligned(t.nbytes) for t in self.pebbled.layouts[i] if not self._apart(t)) + \
            2 * self.n_seqs * aligned(self._kv_bytes(i)) * (self.kv_source(i) == i)

    def _slot_views(self, slot: int, i: int, n_seqs: int) -> tuple[LayerWeights, list[tuple[Array, Array]]]:
        """Layer i's weights and n_seqs sequences' caches over slot `slot` (made once: the slots live as
        long as the plan)."""
        views = self._views.get((slot, i, n_seqs))
        if views is None:
            views = self._views[slot, i, n_seqs] = self._carve(slot, i, n_seqs)
        return views

    def _carve(self, slot: int, i: int, n_seqs: int) -> tuple[LayerWeights, list[tuple[Array, Array]]]:
        buffer, offset, arrays = self.slots[slot], 0, {}

        def carve(nbytes: int) -> Array:
            nonlocal offset
            raw = buffer[offset:offset + nbytes]
            offset += aligned(nbytes)
            return raw

        for t in self.pebbled.layouts[i]:
            arrays[t.name] = self._host_view(i, t) if self._apart(t) else \
                t.view(carve(t.nbytes), self.dtype, self.pebbled.kernels)
        caches = [tuple(carve(self._kv_bytes(i)).view(self.kv_dtype).reshape(self.kv_shapes[i]) for _ in range(2))
                  for _ in range(n_seqs if self.kv_source(i) == i else 0)]
        return LayerWeights(**arrays), caches

    # -- a forward pass: begin_pass, then weights / caches and done for every layer in order

    def begin_pass(self, seqs: Sequence[tuple[int, int, int]]) -> None:
        """A forward pass of (sequence, position, tokens) for each sequence in it is about to run."""
        if not seqs or len(seqs) > self.n_seqs:
            raise ValueError(f"a pass runs 1..{self.n_seqs} sequences, got {len(seqs)}")
        self.pass_seqs = list(seqs)
        self.batch_index = {seq: b for b, (seq, _, _) in enumerate(seqs)}
        self._slots_shared("python")
        most = max(n for _, _, n in seqs)
        if most <= self.pebbled.kernels.max_vec:
            self.pebbled.kernels.release_workspace()  # the fused kernels take it all: no expanded matrix
        elif largest := self.pebbled.expansion_elements(most):  # at its largest before a matrix holds a view:
            self.pebbled.kernels.workspace(largest)  # grown later, the view held kept the old one (H200: +33.5 MB)
        stats = self.store.stats()
        self._pass_start = (stats.bytes_restored, stats.restores)
        for n in range(min(len(self.slots), len(self.streamed))):
            self._restore(n)

    def weights(self, i: int) -> LayerWeights:
        if i in self.resident:
            return self.resident[i]
        slot = self.order[i] % len(self.slots)
        self.backend.wait(self.ready[slot])
        return self.in_slot[slot][0]

    def caches(self, i: int, seq: int) -> tuple[Array, Array]:
        """Sequence `seq`'s K and V caches of layer i [n_ctx, n_head_kv, head_dim] (call after `weights(i)`)."""
        if self.kv_source(i) != i:
            return self.caches(self.kv_source(i), seq)
        if i in self.resident:
            views = self._resident_kv.get((i, seq))
            if views is None:
                views = self._resident_kv[i, seq] = tuple(
                    self.store.device_array(i, tid, self.kv_dtype, self.kv_shapes[i]) for tid in kv_ids(seq))
            return views
        return self.in_slot[self.order[i] % len(self.slots)][1][self.batch_index[seq]]

    def experts(self, i: int) -> Any:
        """Where a prefill's layer i takes its experts from (moe.moe_ffn's `experts`): with experts as pebbles
        where the arrays are device memory, each restored from its entry into one working slot; None (the
        merged tensors) elsewhere, which on host memory are the host tier's, computed from in place."""
        if i not in self._expert_layers or not (self.backend.arrays_on_device or self.slots_everywhere):
            return None
        if self._prefill_slot is None:
            self._prefill_slot = self.xp.empty(self.plan.memory.experts.slot_bytes, np.uint8)
        return experts.PrefillExperts(self.pebbled, i, self._prefill_slot)

    def expert_device_bytes(self) -> int:
        """Device memory held for experts as pebbles: the decoder's slots and a prefill's working slot."""
        held = self._decoder.stats()["expert_device_bytes"] if self._decoder is not None else 0
        return held + (0 if self._prefill_slot is None else self._prefill_slot.nbytes)

    def pass_caches(self, i: int) -> list[tuple[Array, Array]]:
        """`caches(i, seq)` of every sequence of the pass, in its order (a streamed layer's slot holds them so)."""
        if i in self.resident or self.kv_source(i) != i:
            return [self.caches(i, seq) for seq, _, _ in self.pass_seqs]
        return self.in_slot[self.order[i] % len(self.slots)][1]

    def done(self, i: int) -> None:
        if i in self.order:
            n = self.order[i]
            slot = n % len(self.slots)
            _, caches = self.in_slot[slot]
            self.backend.record(self.computed[slot])
            self.backend.wait(self.computed[slot], self.copy_stream)
            # On host memory the caches are the entries themselves (_restore): nothing to write back.
            owned = self.backend.arrays_on_device and self.kv_source(i) == i
            for (seq, pos, n_tokens), (k, v) in zip(self.pass_seqs, caches if owned else ()):
                k_id, v_id = kv_ids(seq)
                for start, stop in ring_rows(pos, n_tokens, self.kv_shapes[i][0]):
                    offset = start * self.row_bytes[i]
                    self.store.write(i, k_id, offset, k[start:stop], stream=self.copy_stream)
                    self.store.write(i, v_id, offset, v[start:stop], stream=self.copy_stream)
            if n + len(self.slots) < len(self.streamed):
                self._restore(n + len(self.slots))
            if i == self.streamed[-1]:
                self._sample_memory()
        if i == self.n_layers - 1:
            self._charge()

    def _restore(self, n: int) -> None:
        """Restores the n-th streamed layer, and the KV of every sequence in the pass, into slot n % slots
        (queued on the copy stream). Where the arrays are host memory (host, stub), the store's host tier
        is memory the kernels read as well as a slot: the weights and the KV caches are computed from it
        in place (host_array; new KV rows are written into the entries themselves), nothing copied."""
        i, slot = self.streamed[n], n % len(self.slots)
        if not self.backend.arrays_on_device:
            self.in_slot[slot] = (self._host_weights(i), [self._host_caches(i, seq) for seq, _, _ in self.pass_seqs])
            return
        weights, caches = self._slot_views(slot, i, len(self.pass_seqs))
        if self.kv_source(i) != i:  # the caches are its source's, resident
            caches = [self.caches(i, seq) for seq, _, _ in self.pass_seqs]
        views = (weights, caches)
        for t in self.pebbled.layouts[i]:
            if not self._apart(t):
                self.store.restore(i, t.tensor_id, bytes_of(getattr(weights, t.name)), stream=self.copy_stream)
        for (seq, pos, _), (k, v) in zip(self.pass_seqs, caches if self.kv_source(i) == i else ()):
            held = min(pos, self.kv_shapes[i][0])  # a sliding layer's ring holds its window at most
            if held:
                k_id, v_id = kv_ids(seq)
                self.store.read(i, k_id, 0, k[:held], stream=self.copy_stream)
                self.store.read(i, v_id, 0, v[:held], stream=self.copy_stream)
        self.backend.record(self.ready[slot], self.copy_stream)
        self.in_slot[slot] = views

    def _host_weights(self, i: int) -> LayerWeights:
        """Streamed layer i's weights in the host tier, computed from in place (host memory). Made once per
        plan: the host copies stay put while it runs."""
        if i not in self.host_views:
            self.host_views[i] = LayerWeights(**{t.name: self._host_view(i, t) for t in self.pebbled.layouts[i]})
        return self.host_views[i]

    def _host_caches(self, i: int, seq: int) -> tuple[Array, Array]:
        """... and sequence `seq`'s caches of it (an entry's KV is erased only by a plan of another num_ctx or
        fewer sequences, which makes new StoreLayers)."""
        if self.kv_source(i) != i:
            return self.caches(self.kv_source(i), seq)
        if (i, seq) not in self.host_kv:
            self.host_kv[i, seq] = tuple(self.store.host_array(i, tid, self.kv_dtype, self.kv_shapes[i])
                                         for tid in kv_ids(seq))
        return self.host_kv[i, seq]

    def _charge(self) -> None:
        """Divides what the pass restored equally among its sequences."""
        stats, (bytes_before, restores_before) = self.store.stats(), self._pass_start
        share = 1 / len(self.pass_seqs)
        for seq, pos, _ in self.pass_seqs:
            cost = self.costs.setdefault(seq, SequenceCost())
            cost.bytes_restored += (stats.bytes_restored - bytes_before) * share
            cost.restores += (stats.restores - restores_before) * share
            cost.passes.append((pos, (stats.bytes_restored - bytes_before) * share, len(self.pass_seqs)))

    # -- a decode step in one native call

    # Streamed layers go through the decoder's slots (this plan's own, copied into by the native step) where
    # the arrays are device memory; where they are host memory each is computed from the host tier in place.
    # The tests set this to take the slots' path on the host too.
    slots_everywhere = False

    def _slots_shared(self, user: str) -> None:
        """The slots pass between this plan's layer-by-layer passes (prefill) and the decoder's steps, which
        copy on streams of their own: on the device, each waits for the other's copies to end first."""
        if user != self._slots_user and self.streamed and self._decoder is not None and \
                self.backend.arrays_on_device:
            self.backend.synchronize()
        self._slots_user = user

    def decoder(self) -> Decoder:
        """This plan's decoder over every layer and every sequence's caches (made at its first step)."""
        if self._decoder is None:
            weights, caches, streamed = [], [], {}
            through_slots = self.backend.arrays_on_device or self.slots_everywhere
            for seq in range(self.n_seqs):
                self.pebbled.ensure_kv(seq)
            for i in range(self.n_layers):
                if i in self.resident:
                    weights.append(self.resident[i])
                    caches.append([self.caches(i, seq) for seq in range(self.n_seqs)])
                elif through_slots:  # the views give the types and shapes; the decoder places its own
                    slot_weights, slot_caches = self._slot_views(self.order[i] % len(self.slots), i, self.n_seqs)
                    weights.append(slot_weights)
                    # a Gemma 4 layer reading another's caches has none in the slot: its (resident) source's
                    caches.append(slot_caches if self.kv_source(i) == i else
                                  [self.caches(i, seq) for seq in range(self.n_seqs)])
                    streamed[i] = {t.name: t.tensor_id for t in self.pebbled.layouts[i]}
                else:
                    weights.append(self._host_weights(i))
                    caches.append([self._host_caches(i, seq) for seq in range(self.n_seqs)])
            self.in_slot = [None] * len(self.slots)  # the decoder writes into the slots: the next pass restores
            stored = experts.decoder_experts(self)
            for i in streamed if stored else ():  # a streamed layer's experts come from the store, one by one
                streamed[i] = {name: tid for name, tid in streamed[i].items() if name not in EXPERT_MATRICES}
            self._decoder = self.pebbled.kernels.decoder(
                self.pebbled.model.config, weights, caches, self.outer, self.n_ctx, streamed=streamed or None,
                store=self.store if streamed or stored else None, kv_ids=[kv_ids(seq) for seq in range(self.n_seqs)],
                slots=self.slots if streamed else (), experts=stored,
                expert_policy=self.pebbling.expert_policy, expert_prefetch=self.pebbling.expert_prefetch)
        return self._decoder

    def decode_step(self, seqs: Sequence[int], positions: Sequence[int], x: Array, per_layer: Array | None = None):
        """One token of each of `seqs` at `positions` through every layer and the output in one call (`per_layer`:
        Gemma 4's per-layer inputs of the tokens): float32 logits [len(seqs), n_vocab]."""
        decoder = self.decoder()
        self._slots_shared("native")
        self.pass_seqs = [(seq, pos, 1) for seq, pos in zip(seqs, positions)]
        stats = self.store.stats()
        self._pass_start = (stats.bytes_restored, stats.restores)
        before = decoder.stats()
        logits = decoder.step(seqs, positions, x, per_layer=per_layer)
        self._charge()
        experts.charge(self.costs, seqs, before, decoder.stats())
        return logits

    # -- what it cost

    def _sample_memory(self) -> None:
        used = self.backend.used_memory()
        if used is not None:
            self.peak_sample = max(self.peak_sample, used.bytes)
            self.measured_by = used.how

    def report(self, stats, seq: int = 0) -> dict[str, Any]:
        """The `pebbling` object of sequence `seq`'s final response (report.py)."""
        self._sample_memory()
        return pebbling_report(self, stats, seq)

    def release(self) -> None:
        """The plan is over: an idle model holds no workspace."""
        self.pebbled.kernels.release_workspace()


class SequenceLayers:
    """One sequence's LayerSource over a StoreLayers shared with the other sequences of its batch."""

    def __init__(self, shared: StoreLayers, seq: int):
        self.shared, self.seq = shared, seq
        self.n_ctx, self.xp, self.outer = shared.n_ctx, shared.xp, shared.outer
        self.attend_kernels = shared.attend_kernels

    @property
    def plan(self) -> Plan:
        return self.shared.plan

    def begin(self, pos: int, n_tokens: int) -> None:
        self.shared.begin_pass([(self.seq, pos, n_tokens)])

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        return (self.shared.weights(i), *self.shared.caches(i, self.seq))

    def experts(self, i: int) -> Any:
        return self.shared.experts(i)

    def done(self, i: int) -> None:
        self.shared.done(i)

    def decode_step(self, positions: Sequence[int], x: Array, per_layer: Array | None = None):
        return self.shared.decode_step([self.seq], positions, x, per_layer)

    def shift_context(self, n_keep: int, n_discard: int, n_past: int) -> None:
        shift_entries(self.shared, self.seq, n_keep, n_discard, n_past)

    def report(self, stats) -> dict[str, Any]:
        report = self.shared.report(stats, self.seq)
        if self.shared.n_seqs == 1:
            self.shared.release()  # alone: the request is over
        return report

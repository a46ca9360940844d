"""A plan run through a pebble store for one request: the LayerSource that streams.

Resident layers are computed in place from the store's device tier; streamed layers are restored into
two working slots (the next one while the current one computes) and their new KV rows saved back. Where
the arrays are host memory (the host and stub backends) a streamed layer's weights are computed from the
host tier in place instead, so that streaming there costs no copy of them.
The backend's device operations order copies against compute (streams and events on the GPU, no-ops
where a copy is done when its call returns).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..model import LayerWeights
from ..store import Strategy
from .options import Options
from .layout import K_ID, V_ID, aligned, bytes_of
from .plan import PebblingOptions, Plan

Array = Any


class StoreLayers:
    """A Plan run through the store for one request.

    Streamed layers go through working slots: slot n % 2 receives the n-th streamed layer's weights and
    its KV rows 0..pos while the layer before it computes; after it computes, its new KV rows are saved
    back. Where copies overlap compute (the GPU) they run on a stream of their own and events order
    them against compute, so no step waits for the whole device."""

    def __init__(self, pebbled: Any, plan: Plan, options: Options, pebbling: PebblingOptions):
        """`pebbled`: the PebbledModel whose store holds the layers."""
        self.pebbled, self.plan, self.pebbling = pebbled, plan, pebbling
        self.backend = backend = pebbled.backend
        self.store, self.xp, self.dtype, self.outer = pebbled.store, pebbled.xp, pebbled.dtype, pebbled.outer
        self.decode_kernels = pebbled.kernels if pebbled.fused_decode else None
        self.n_ctx = options.num_ctx
        self.kv_shape = pebbled.kv_shape(self.n_ctx)
        self.kv_row_bytes = int(np.prod(self.kv_shape[1:])) * self.dtype.itemsize
        pebbled.kernels.release_workspace()
        backend.free_pool()  # measure this request, not the last
        pebbled.prepare(plan, self.n_ctx)

        self.resident = {i: self._resident_views(i) for i in plan.resident}
        self.streamed = list(plan.streamed)
        self.order = {layer: n for n, layer in enumerate(self.streamed)}
        slot_bytes = max((self._slot_size(i) for i in self.streamed), default=0)
        self.slots = [self.xp.empty(slot_bytes, np.uint8) for _ in range(plan.n_slots)]
        self.slot_bytes = slot_bytes
        self.in_slot: list[tuple] = [None] * plan.n_slots  # (weights, k, v) of the layer each holds
        self.host_views: dict[int, LayerWeights] = {}  # streamed layers' weights in the host tier (host memory)
        self.copy_stream = backend.copy_stream()
        self.ready = [backend.event() for _ in self.slots]     # a slot's layer is restored
        self.computed = [backend.event() for _ in self.slots]  # a slot's layer has computed
        self.peak_sample = 0
        self.forwards: list[tuple[int, int]] = []  # (position, bytes restored before) per forward pass
        self._sample_memory()

    # -- views

    def _resident_views(self, i: int) -> tuple[LayerWeights, Array, Array]:
        view, kernels = self.store.device_array, self.pebbled.kernels
        weights = {t.name: t.view(view(i, t.tensor_id, np.uint8, (t.nbytes,)), self.dtype, kernels)
                   for t in self.pebbled.layouts[i]}
        return (LayerWeights(**weights), view(i, K_ID, self.dtype, self.kv_shape),
                view(i, V_ID, self.dtype, self.kv_shape))

    def _slot_size(self, i: int) -> int:
        kv = aligned(int(np.prod(self.kv_shape)) * self.dtype.itemsize)
        return sum(aligned(t.nbytes) for t in self.pebbled.layouts[i]) + 2 * kv

    def _slot_views(self, slot: int, i: int) -> tuple[LayerWeights, Array, Array]:
        buffer, offset, arrays = self.slots[slot], 0, {}

        def carve(nbytes: int) -> Array:
            nonlocal offset
            raw = buffer[offset:offset + nbytes]
            offset += aligned(nbytes)
            return raw

        for t in self.pebbled.layouts[i]:
            arrays[t.name] = t.view(carve(t.nbytes), self.dtype, self.pebbled.kernels)
        kv_bytes = int(np.prod(self.kv_shape)) * self.dtype.itemsize
        k, v = (carve(kv_bytes).view(self.dtype).reshape(self.kv_shape) for _ in range(2))
        return LayerWeights(**arrays), k, v

    # -- the LayerSource protocol

    def begin(self, pos: int, n_tokens: int) -> None:
        self.pos, self.n_tokens = pos, n_tokens
        if n_tokens <= self.pebbled.kernels.max_vec:  # the fused kernels take it all: no expanded matrix from here on
            self.pebbled.kernels.release_workspace()
        self.forwards.append((pos, self.store.stats().bytes_restored))
        for n in range(min(len(self.slots), len(self.streamed))):
            self._restore(n)

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        if i in self.resident:
            return self.resident[i]
        slot = self.order[i] % len(self.slots)
        self.backend.wait(self.ready[slot])
        return self.in_slot[slot]

    def done(self, i: int) -> None:
        if i not in self.order:
            return
        n = self.order[i]
        slot = n % len(self.slots)
        _, k, v = self.in_slot[slot]
        self.backend.record(self.computed[slot])
        self.backend.wait(self.computed[slot], self.copy_stream)
        rows = slice(self.pos, self.pos + self.n_tokens)
        offset = self.pos * self.kv_row_bytes
        self.store.write(i, K_ID, offset, k[rows], stream=self.copy_stream)
        self.store.write(i, V_ID, offset, v[rows], stream=self.copy_stream)
        if n + len(self.slots) < len(self.streamed):
            self._restore(n + len(self.slots))
        if i == self.streamed[-1]:
            self._sample_memory()

    def _restore(self, n: int) -> None:
        """Restores the n-th streamed layer into slot n % slots (queued on the copy stream). Where the
        arrays are host memory (host, stub), the store's host tier is memory the kernels read as well
        as a slot: the weights are computed from it in place (host_array), only the KV rows copied."""
        i, slot = self.streamed[n], n % len(self.slots)
        weights, k, v = views = self._slot_views(slot, i)
        if not self.backend.arrays_on_device:
            if i not in self.host_views:  # made once per request: the host copies stay put while it runs
                kernels = self.pebbled.kernels
                self.host_views[i] = LayerWeights(**{
                    t.name: t.view(self.store.host_array(i, t.tensor_id, np.uint8, (t.nbytes,)), self.dtype, kernels)
                    for t in self.pebbled.layouts[i]})
            weights = self.host_views[i]
            views = (weights, k, v)
        for t in self.pebbled.layouts[i] if self.backend.arrays_on_device else ():
            self.store.restore(i, t.tensor_id, bytes_of(getattr(weights, t.name)), stream=self.copy_stream)
        if self.pos:
            self.store.read(i, K_ID, 0, k[:self.pos], stream=self.copy_stream)
            self.store.read(i, V_ID, 0, v[:self.pos], stream=self.copy_stream)
        self.backend.record(self.ready[slot], self.copy_stream)
        self.in_slot[slot] = views

    # -- what it cost

    def _sample_memory(self) -> None:
        used = self.backend.used_memory()
        if used is not None:
            self.peak_sample = max(self.peak_sample, used.bytes)
            self.measured_by = used.how

    def report(self, stats) -> dict[str, Any]:
        """The `pebbling` object of a final response (DESIGN.md), from this request's store stats."""
        self._sample_memory()
        self.pebbled.kernels.release_workspace()  # the request is over: an idle model holds none
        store = self.store.stats()
        plan, memory = self.plan, self.plan.memory
        if self.peak_sample:
            measured, how = self.peak_sample, f"measured ({self.measured_by})"
        else:
            measured = (store.device_peak_bytes + len(self.slots) * self.slot_bytes + memory.fixed_bytes
                        + memory.workspace_bytes + memory.overhead_bytes)
            how = ("byte-accounted (store device tier peak + working slots + output weights + "
                   "workspace reservation; no GPU measured)")
        # Decode steps are the forward passes that start past the prompt.
        starts = [b for pos, b in self.forwards if pos >= stats.prompt_tokens] + [store.bytes_restored]
        decoded = len(starts) - 1
        return {
            "strategy": _strategy_name(plan.strategy),
            "enabled": self.pebbling.enabled is not False,
            "weights": self.pebbled.weights,
            "fused_decode": self.decode_kernels is not None,
            "backend": self.backend.name,
            "resident_layers": len(plan.resident),
            "n_layers": memory.n_layers,
            "budget_bytes": plan.budget_bytes,
            "estimated_peak_bytes": plan.estimated_peak_bytes,
            "measured_peak_bytes": int(measured),
            "measured_peak_how": how,
            "bytes_restored": int(store.bytes_restored),
            "restores": int(store.restores),
            "bytes_restored_per_token": (starts[-1] - starts[0]) // decoded if decoded else None,
            # What the whole process holds, beside the store's accounting above (which, on host memory,
            # counts each tier's bytes and not the interpreter, the model's own arrays or the tokenizer).
            **process_memory(),
        }


def process_memory() -> dict[str, int | None]:
    """This process's resident memory now and at its peak (Linux's VmRSS and VmHWM), measured; None
    where /proc does not say."""
    out: dict[str, int | None] = {"process_rss_bytes": None, "process_peak_rss_bytes": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key = "process_rss_bytes" if line.startswith("VmRSS") else "process_peak_rss_bytes"
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _strategy_name(strategy: Strategy) -> str:
    return f"adaptive:{strategy.arg}" if strategy.name == "adaptive" else strategy.name

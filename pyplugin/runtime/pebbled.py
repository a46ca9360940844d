"""A model whose layers live in a pebble store: the one place where the plan, the store and the model
meet. Its layers are saved once, in the form the model was loaded in; each request's plan only
changes which of them are resident, and `generation()` turns options into a running request.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from ..errors import ClosedError, OptionsError
from ..kv_types import KV_TYPES, KVType, default_kv_type, kv_type
from ..model import LayerWeights, Model, OuterWeights, QuantWeight, embed, layer_forward, output_logits
from ..model.gguf_file import drop_file_pages, map_file_pages
from ..model.qweight import needs_expansion
from ..store import Backend, select_backend
from ..store.abi import aligned
from ..store.arena import HostArena, fits, use_mmap
from ..store.decoder_scratch import model_scratch_bytes
from ..store.kernels import EXPERT_MATRICES
from ..xp import to_numpy
from .constraint import Constraint
from .conversations import ParkedConversations
from .generation import Generation
from .layout import WEIGHT_IDS, StoredTensor, bytes_of, kv_ids, tensor_desc
from .options import Options
from .plan import (MEASURED_MARGIN_BYTES, MemoryModel, PebblingOptions, Plan, adaptive_budget, format_bytes,
                   make_plan, smallest_footprint, workspace_bytes)
from .store_layers import StoreLayers
from . import experts


class PebbledModel:
    """A model whose layers live in a pebble store: saved once to the host tier, in the form the model
    was loaded in (typed pebbles: a matrix in its GGUF type and shape when quantized, the compute type
    when expanded); each request's plan only changes which of them are resident, so a new strategy
    never reads the model file again. The store's backend decides the array module (CuPy on cuda,
    numpy elsewhere) and the kernels that compute from quantized pebbles."""

    def __init__(self, model: Model, *, backend: str | Backend | None = None, keep_host_weights: bool = True,
                 parked_kv_bytes: int = 0):
        """`keep_host_weights=False` hands the model's host layers over to the store: they are
        released as they are saved, so a server holds each layer once, not twice. `parked_kv_bytes`: host memory for the
        caches of conversations a new request displaces (conversations.py; 0: none kept)."""
        cfg = model.config
        self.model = model
        self.backend = select_backend(backend)
        self.store = self.backend.open_store(0, cfg.n_layer, "minimal")
        self.xp, self.dtype = self.backend.xp, self.backend.compute_dtype
        self.weights, self.kernels = model.weights, self.backend.kernels
        self.layouts: list[list[StoredTensor]] = []
        # The host library computes from the weights in place: from a copy in huge pages (store/arena.py),
        # or from the file's own mapping where PEBBLING_USE_MMAP asks.
        arena, outer = None, model.outer_weights(self.kernels)
        if self.backend.name == "host" and not use_mmap():
            placed = [a.data for i in range(cfg.n_layer) for _, a in model.layers[i].arrays() if isinstance(a, QuantWeight)]
            size = HostArena.size_of(placed + ([outer.output.data] if isinstance(outer.output, QuantWeight) else []))
            arena = HostArena(size) if fits(size) else None
        for i in range(cfg.n_layer):
            lw, layout = model.layers[i], []
            for name, array in lw.arrays():
                if isinstance(array, QuantWeight):
                    data = np.ascontiguousarray(array.data)
                    tensor = StoredTensor(WEIGHT_IDS[name], name, array.shape, data.nbytes, array.qtype)
                    desc = tensor_desc(array.qtype, array.shape)
                else:
                    data = np.ascontiguousarray(array, dtype=self.dtype)
                    tensor = StoredTensor(WEIGHT_IDS[name], name, data.shape, data.nbytes)
                    desc = tensor_desc(self.dtype, data.shape)
                if isinstance(array, QuantWeight):
                    # The host library keeps the bytes it is given (no copy); a store that copied them, or a
                    # copy in the arena, lets the file's pages go.
                    if arena is not None:
                        map_file_pages(array.data)  # one call maps the pages the copy reads, not a fault each
                    placed = arena.place(data) if arena is not None else data
                    if self.store.save_borrowed(i, tensor.tensor_id, placed, desc=desc) and placed is data:
                        map_file_pages(array.data)
                    else:
                        drop_file_pages(array.data)
                else:
                    self.store.save(i, tensor.tensor_id, data, tier="host", desc=desc)
                layout.append(tensor)
            self.layouts.append(layout)
            if not keep_host_weights:
                model.layers[i] = None  # the store's copy is the one that counts from here on
        if not keep_host_weights:
            model.release_layers()
        if arena is not None and isinstance(outer.output, QuantWeight):  # read whole at every token, as a layer
            output = outer.output
            map_file_pages(output.data)
            outer = replace(outer, output=replace(output, data=arena.place(output.data)))
            drop_file_pages(output.data)
        self.outer: OuterWeights = outer
        self._kv_ctx: int | None = None        # the num_ctx the KV entries are sized for
        self.plan_in_use: Plan | None = None    # the plan the store was last made to hold (prepare)
        self.kv: KVType = KV_TYPES[default_kv_type(self.model.config.head_dim)]  # ... and the type they hold
        self._kv_seqs: set[int] = set()         # the sequences whose KV entries exist
        self._kv_tokens: dict[int, list[int]] = {}  # per sequence: the tokens its KV entries hold, in order
        self._kv_used: dict[int, int] = {}      # per sequence: when a request last claimed it
        self._kv_clock = 0
        self.parked = ParkedConversations(self, parked_kv_bytes)
        self.restored: dict[int, int] = {}      # per sequence: tokens its last claim brought back from the host tier
        self._overhead: int | None = None
        self._overhead_lock = threading.RLock()

    def close(self) -> None:
        self.store.close()

    def layer_weights(self, i: int) -> LayerWeights:
        """A copy of layer i's weights from the store, in new arrays of the compute module."""
        arrays = {}
        for t in self.layouts[i]:
            arrays[t.name] = t.view(self.xp.empty(t.nbytes, np.uint8), self.dtype, self.kernels)
            self.store.restore(i, t.tensor_id, bytes_of(arrays[t.name]))
        return LayerWeights(**arrays)

    @property
    def weight_bytes(self) -> int:
        """Every layer's weights as the store holds them."""
        return sum(t.nbytes for layout in self.layouts for t in layout)

    def expansion_elements(self, n_tokens: int) -> int:
        """fp16 elements of the workspace that a chunk of n_tokens expands quantized matrices into:
        the largest such matrix when the chunk is past what the fused kernels take, else none (and
        none on kernels that multiply prefill chunks from the stored blocks: tiled_matmul)."""
        if n_tokens <= self.kernels.max_vec or self.kernels.tiled_matmul:
            return 0
        expanded = [t.shape[0] * t.shape[1] for layout in self.layouts for t in layout
                    if t.qtype is not None and needs_expansion(t.qtype, self.dtype)]
        return max(expanded, default=0)

    def kv_shape(self, n_ctx: int, i: int = 0, kv: KVType | None = None) -> tuple[int, int, int]:
        """Layer i's K (or V) cache for a context of n_ctx, of type `kv` (else the entries' own): a sliding
        layer keeps its window only; a block type's last dimension is bytes (kv_types.py)."""
        cfg = self.model.config
        lcfg = cfg.for_layer(i)  # its own head size and KV heads (Gemma 4's differ by layer)
        return (kv or self.kv).shape(cfg.kv_rows(i, n_ctx), lcfg.n_head_kv, lcfg.head_dim)

    def memory_model(self, options: Options, prompt_tokens: int | None = None, n_seqs: int = 1,
                     pebbling: PebblingOptions | None = None) -> MemoryModel:
        """Device memory for these options; knowing the prompt's length sizes the workspace for the
        chunks and context this request can reach instead of a full num_batch chunk at num_ctx.
        `n_seqs`: sequences decoding together (a batch), each with its own KV cache at num_ctx. `pebbling`
        asking for experts as pebbles: the layers' dense part, and the experts' slots (runtime.experts)."""
        cfg, isz = self.model.config, self.dtype.itemsize
        kv = kv_type(options.kv_type)
        kv.check_head_dim(cfg.head_dim)
        kv_token = 2 * cfg.n_head_kv * kv.row_bytes(cfg.head_dim)  # K and V of a token, in the KV type
        kv_tokens = [cfg.kv_token_bytes(i, kv.row_bytes) for i in range(cfg.n_layer)]  # ... of each layer's own
        output = self.outer.output
        output_bytes = output.nbytes if isinstance(output, QuantWeight) else output.size * isz
        fixed = output_bytes + (self.outer.output_norm.size + 2 * options.num_ctx * cfg.head_dim) * isz
        # Prefill chunks past the fused kernels also hold the fp16 expansion of a quantized matrix;
        # decode, which multiplies by the quantized bytes, does not (StoreLayers drops it then). A batch's
        # decode step holds the activations of one token per sequence.
        if prompt_tokens is None:
            request = f"any prompt (prefill chunks of num_batch {options.num_batch} at num_ctx {options.num_ctx})"
            chunk = min(options.num_batch, options.num_ctx)
            workspace = max(workspace_bytes(cfg, chunk, options.num_ctx, isz) + 2 * self.expansion_elements(chunk),
                            n_seqs * workspace_bytes(cfg, 1, options.num_ctx, isz))
        else:
            chunk = min(options.num_batch, prompt_tokens)
            reach = options.num_ctx if options.num_predict < 0 else prompt_tokens + options.num_predict
            request = (f"a prompt of {prompt_tokens} tokens, "
                       + ("generating to the end of the context" if options.predict_limit is None else
                          f"generating up to {options.predict_limit}") + f" at num_ctx {options.num_ctx}")
            workspace = max(
                workspace_bytes(cfg, chunk, prompt_tokens, isz) + 2 * self.expansion_elements(chunk),
                n_seqs * workspace_bytes(cfg, 1, min(options.num_ctx, reach), isz))          # decode
        expert_slots = experts.expert_memory(self, pebbling)
        held = (lambda t: t.name not in EXPERT_MATRICES) if expert_slots else (lambda t: True)
        if expert_slots and self.backend.arrays_on_device:  # a prefill restores experts into one slot
            workspace += expert_slots.slot_bytes
        kv_entry = [cfg.kv_rows(i, options.num_ctx) * kv_tokens[i] // 2 for i in range(cfg.n_layer)]  # K or V
        pages = lambda n: max(0, self.backend.device_footprint(n) - aligned(n))  # noqa: E731 - what pages add
        return MemoryModel(
            layer_weight_bytes=tuple(sum(aligned(t.nbytes) for t in layout if held(t)) for layout in self.layouts),
            layer_kv_bytes=tuple(aligned(n) * 2 for n in kv_entry), kv_page_bytes=tuple(2 * pages(n) for n in kv_entry),
            weight_page_bytes=tuple(sum(pages(t.nbytes) for t in layout if held(t)) for layout in self.layouts),
            page_bytes=self.backend.device_page_bytes, decoder_bytes=model_scratch_bytes(cfg, options.num_ctx, n_seqs)
            if self.backend.arrays_on_device else 0,
            kv_bytes_per_token=kv_token, layer_kv_token_bytes=tuple(kv_tokens), fixed_bytes=fixed,
            workspace_bytes=workspace,
            kv_windows=tuple(cfg.sliding_window if cfg.is_sliding(i) else 0 for i in range(cfg.n_layer)),
            overhead_bytes=self._overhead_bytes(), margin_bytes=MEASURED_MARGIN_BYTES if self.backend.measures_memory else 0,
            n_seqs=n_seqs, n_ctx=options.num_ctx,
            request=request if n_seqs == 1 else f"{n_seqs} sequences decoding together, {request}",
            experts=expert_slots, pinned=cfg.kv_shared)

    def restored_bytes_per_token(self, plan: Plan, context_tokens: int) -> int:
        """What a decode step under `plan` restores per token: the streamed layers' bytes where the backend's
        arrays are device memory (nothing where they are host memory, since a streamed layer is then
        computed from the host tier in place: StoreLayers._restore); and with experts as pebbles, on every
        backend, the routed experts its cache misses (copied into the decoder's expert slots)."""
        streamed = plan.restored_bytes_per_token(context_tokens) if self.backend.arrays_on_device else 0
        return streamed + plan.expert_restored_bytes_per_token()

    def longest_prompt_within(self, options: Options, budget: int) -> int:
        """The longest prompt (tokens, at most num_ctx - 1) whose request fits `budget` with minimal,
        0 where none does: the smallest footprint grows with the prompt (its prefill chunk and context)."""
        lo, hi = 0, options.num_ctx - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if smallest_footprint(self.memory_model(options, mid)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def measure_overhead(self) -> None:
        """Measures the backend's overhead on the calling thread, where it is not yet measured: a server
        calls it on the thread that computes, whose cuBLAS handle (one a thread, held while it lives) is
        then part of what every plan counts."""
        self._overhead_bytes()

    def _overhead_bytes(self) -> int:
        """The backend's own fixed cost (Backend.overhead_bytes: the process's, the most measured); 0 on host
        and stub, which account bytes. Measured after a warm-up forward, and never lowered."""
        if not self.backend.measures_memory:
            return 0
        with self._overhead_lock:
            if self._overhead is None:
                self._warm_up()
                self._overhead = 0
            self.backend.free_pool()
            self._overhead = max(self._overhead, self.backend.overhead_bytes() or 0)
            return self._overhead

    def _warm_up(self) -> None:
        """A prefill and a decode step of one layer and the output, so that the kernels and library
        handles every request loads are in device memory before the overhead is measured."""
        cfg, xp = self.model.config, self.xp
        weights = self.layer_weights(0)
        n = self.kernels.max_vec + 1  # a chunk past the fused kernels: expansion and GEMM load too
        first = cfg.for_layer(0)  # its own head size and KV heads (a Gemma 4's differ by layer)
        k, v = (xp.zeros(self.kv.shape(n + 1, first.n_head_kv, first.head_dim), self.kv.dtype) for _ in range(2))
        x = embed(self.outer, list(range(n)), xp)
        per_layer = (lambda t: xp.zeros((t, cfg.n_embd_per_layer), x.dtype) if cfg.n_embd_per_layer else None)  # noqa: E731
        x = layer_forward(first, x, weights, k, v, 0, per_layer=per_layer(n))
        x = layer_forward(first, x[-1:], weights, k, v, n, per_layer=per_layer(1))
        to_numpy(output_logits(cfg, self.outer, x[-1]))
        del weights, k, v, x
        self.kernels.release_workspace()

    def budget(self, pebbling: PebblingOptions, others: int = 0) -> int | None:
        """The request's limit, else (adaptive, where device memory is measured) the device memory this
        model may use: what is free, plus what this process holds, less `others`, what the other models
        this process has loaded hold on the device (their resident layers stay there while loaded)."""
        if pebbling.memory_limit is not None or not self.backend.measures_memory:
            return pebbling.memory_limit
        return adaptive_budget(self.backend.free_memory(), self.backend.used_memory(), others)

    def device_bytes_held(self) -> int:
        """Device memory this model holds between requests: its store's device tier and its output
        weights (0 once closed)."""
        try:
            held = self.store.stats().device_bytes
        except ClosedError:  # unloaded, maybe while another request was asking
            return 0
        return held + (int(self.outer.output.nbytes) if self.backend.arrays_on_device else 0)

    def plan(self, options: Options, pebbling: PebblingOptions, prompt_tokens: int | None = None,
             others: int = 0, n_seqs: int = 1) -> Plan:
        """The plan for a request (`prompt_tokens`: its prompt's length; `others`: see `budget`), or for a
        batch of `n_seqs` requests with these options (its KV caches all counted in the budget)."""
        strategy = pebbling.effective_strategy
        budget = self.budget(pebbling, others) if strategy.name == "adaptive" else pebbling.memory_limit
        try:
            return make_plan(self.memory_model(options, prompt_tokens, n_seqs, pebbling), strategy, budget)
        except OptionsError as exc:  # say which smaller KV type would fit, where one would
            for t in KV_TYPES.values():
                if t.row_bytes(64) >= kv_type(options.kv_type).row_bytes(64) or self.model.config.head_dim % t.block:
                    continue
                try:
                    plan = make_plan(self.memory_model(replace(options, kv_type=t.name), prompt_tokens, n_seqs,
                                                       pebbling), strategy, budget)
                except OptionsError:
                    continue
                raise type(exc)(f"{exc}; with pebbling_kv_type {t.name!r} it fits (about "
                                f"{format_bytes(plan.estimated_peak_bytes)}, estimate)") from None
            raise

    def generation(self, options: Options, pebbling: PebblingOptions, prompt_tokens: int | None = None, *,
                   plan: Plan | None = None, others: int = 0, should_stop: Callable[[], bool] | None = None,
                   constraint: Constraint | None = None, logprobs: int | None = None) -> Generation:
        """One request alone through the store: its plan (`plan`, else made from the options), the store
        made to hold it, and a Generation over those layers (sequence 0's KV entries)."""
        plan = plan or self.plan(options, pebbling, prompt_tokens, others)
        layers = StoreLayers(self, plan, options, pebbling).sequence(0)
        self.claim(0)  # the new request writes over them; its caller says what it left (keep_cache)
        return Generation(self.model, options, layers=layers, should_stop=should_stop, constraint=constraint,
                          logprobs=logprobs)

    # -- KV entries and the conversations they hold

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose K and V sequence 0's KV entries hold, in order."""
        return self._kv_tokens.get(0, [])

    def cached_prefix(self, tokens: Sequence[int], n_ctx: int, seq: int = 0, kv: str | None = None) -> int:
        """How many leading `tokens` sequence `seq`'s KV entries already hold for a request at `n_ctx`
        with KV type `kv` (else the server's; the last token always runs again: its logits are what the
        request samples from first)."""
        if self._kv_ctx != n_ctx or self.kv.name != (kv or default_kv_type(self.model.config.head_dim)):
            return 0
        n = 0
        for a, b in zip(self._kv_tokens.get(seq, ()), tokens[:len(tokens) - 1]):
            if a != b:
                break
            n += 1
        return n

    def best_sequence(self, tokens: Sequence[int], n_ctx: int, free: Sequence[int],
                      reuse: bool = True, kv: str | None = None) -> tuple[int, int]:
        """(sequence, cached tokens) for a request among the `free` sequences of a batch: the one whose KV
        entries hold the longest start of `tokens` (when `reuse`), provided it is at least half of what
        they hold (the request goes on from there, rather than sharing a BOS or a short system prompt
        with another conversation); else the least recently used, so that the conversations of the last
        requests keep their caches longest (whatever start of `tokens` that one holds is still used)."""
        order = sorted(free, key=lambda s: self._kv_used.get(s, -1))
        self.restored = {}
        if not reuse:
            self._park(order[0], n_ctx)
            return order[0], 0
        found = {s: self.cached_prefix(tokens, n_ctx, s, kv) for s in order}
        going_on = [s for s in order if found[s] and 2 * found[s] >= len(self._kv_tokens.get(s, ()))]
        best = max(going_on, key=found.get) if going_on else None  # the first of the longest
        # A parked conversation comes back into entries of its own num_ctx and KV type only: entries of
        # another are made again by the plan (prepare), which would drop what was written into them.
        same = self._kv_ctx == n_ctx and self.kv.name == (kv or default_kv_type(self.model.config.head_dim))
        key, parked = self.parked.best(tokens, n_ctx, self.kv.name) if same else (None, 0)
        if key is not None and parked > (found[best] if best is not None else 0):
            seq = order[0]  # the conversation comes back from the host tier into the least recently used
            self._park(seq, n_ctx, keep=key)
            self.ensure_kv(seq)
            self._kv_tokens[seq] = self.parked.restore(key, seq)
            self.restored[seq] = parked
            return seq, self.cached_prefix(tokens, n_ctx, seq, kv)
        if best is not None:
            return best, found[best]
        self._park(order[0], n_ctx)  # the conversation it holds goes to the host tier, not away
        return order[0], found[order[0]]  # what matches of its cache is still used

    def _park(self, seq: int, n_ctx: int, keep: int | None = None) -> None:
        held = self._kv_tokens.get(seq)
        if held and self._kv_ctx == n_ctx and seq in self._kv_seqs:
            self.parked.park(seq, held, n_ctx, keep)

    def claim(self, seq: int) -> None:
        """Sequence `seq`'s KV entries are about to be written by a new request."""
        self._kv_tokens[seq] = []
        self._kv_clock += 1
        self._kv_used[seq] = self._kv_clock

    def keep_cache(self, generation: Generation) -> None:
        """Remembers what `generation` (the last to run on its sequence) left in its KV entries."""
        self._kv_tokens[getattr(generation.layers, "seq", 0)] = generation.forwarded()

    def ensure_kv(self, seq: int) -> None:
        """Sequence `seq`'s KV entries exist in every layer, placed as the strategy says (call after
        `prepare`)."""
        if seq in self._kv_seqs:
            return
        cfg, pinned = self.model.config, self.plan_in_use.memory.pinned if self.plan_in_use else ()
        for i in cfg.kv_owners:  # a layer reading another's caches has none (Gemma 4)
            zeros = np.zeros(self.kv_shape(self._kv_ctx, i), self.kv.dtype)  # contents past `pos` are never read
            desc = tensor_desc(self.kv.ggml_type, self.kv_shape(self._kv_ctx, i)[:2] + (cfg.for_layer(i).head_dim,))
            for tensor_id in kv_ids(seq):
                self.store.save(i, tensor_id, zeros, desc=desc, tier="device" if i in pinned else "auto")
        self._kv_seqs.add(seq)

    def prepare(self, plan: Plan, n_ctx: int, kv: KVType | None = None) -> None:
        """Makes the store hold the plan: resident layers on the device, KV entries for n_ctx of type `kv`
        (else the server's) and at most the plan's sequences (those of other sequences, and their
        conversations, are dropped)."""
        store = self.store
        kv = kv or KV_TYPES[default_kv_type(self.model.config.head_dim)]
        drop = set(self._kv_seqs) if self._kv_ctx not in (None, n_ctx) or kv != self.kv else \
            {s for s in self._kv_seqs if s >= plan.memory.n_seqs}
        for seq in drop:
            for i in self.model.config.kv_owners:
                for tensor_id in kv_ids(seq):
                    store.erase(i, tensor_id)
            self._kv_seqs.discard(seq)
            self._kv_tokens.pop(seq, None)
        self._kv_ctx, self.kv, self.plan_in_use = n_ctx, kv, plan
        experts.keep_merged_on_host(self, plan.expert_cache is not None)
        store.set_strategy(plan.strategy, device_limit=plan.store_limit)
        for i in plan.memory.pinned:  # resident whatever the strategy (Gemma 4's layers whose caches others read)
            store.prefetch(i)
        store.reset_stats()

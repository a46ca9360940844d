"""The inference loop: prefill in chunks, then decode one token at a time, sampling each; and the one
place where the plan, the store and the model meet.

The loop reaches a layer's state (weights and KV cache) only through a `LayerSource`, asked for
layer i just before it computes and told when it is done. `ResidentLayers` keeps every layer in
memory; `StoreLayers` runs a `Plan` through a pebble store: resident layers are computed in place
from the store's device tier, streamed layers are restored into two device working slots (the next
one while the current one computes) and their new KV rows saved back.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from .backend import open_store
from .errors import OptionsError
from .gpu import used_device_memory
from .model import (KVCache, LayerWeights, Model, ModelConfig, OuterWeights, QuantWeight, embed, layer_forward,
                    output_logits)
from .model.qweight import needs_expansion
from .model.transformer import rope_table
from .options import Options
from .plan import MemoryModel, PebblingOptions, Plan, make_plan
from .quant import MAX_VEC, LayerShape, kernels_for
from .sampling import Sampler
from .strategy import Strategy
from .xp import compute_dtype, to_numpy

Array = Any


class LayerSource(Protocol):
    """Where the loop finds each layer's weights and KV cache."""

    n_ctx: int

    def begin(self, pos: int, n_tokens: int) -> None:
        """A forward pass over positions pos..pos+n_tokens is about to run through every layer."""

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        """Layer i's weights, K cache and V cache [n_ctx, n_head_kv, head_dim], ready to compute."""

    def done(self, i: int) -> None:
        """Layer i has computed (its new KV rows are written in the arrays `layer` gave)."""


class ResidentLayers:
    """Every layer's weights and KV cache held in memory for the whole request (no store)."""

    def __init__(self, model: Model, n_ctx: int, xp: ModuleType = np):
        self.weights = model.resident_layers(xp)
        self.kv = KVCache.allocate(model.config, n_ctx, xp)
        self.n_ctx = n_ctx

    def begin(self, pos: int, n_tokens: int) -> None:
        pass

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        return self.weights[i], self.kv.k[i], self.kv.v[i]

    def done(self, i: int) -> None:
        pass


@dataclass
class Stats:
    """What one request cost, in Ollama's terms."""

    prompt_tokens: int = 0
    prompt_ns: int = 0
    generated_tokens: int = 0
    generate_ns: int = 0
    done_reason: str | None = None     # "stop" (end of generation or a stop string) or "length"


class Generation:
    """One request: its layer source (and so its KV cache), position, sampler and stats."""

    def __init__(self, model: Model, options: Options, *, layers: LayerSource | None = None,
                 xp: ModuleType = np, should_stop: Callable[[], bool] | None = None):
        self.model, self.options, self.xp = model, options, xp
        self.cfg = model.config
        self.layers = layers if layers is not None else ResidentLayers(model, options.num_ctx, xp)
        self.outer = model.outer_weights(xp)
        self.sampler = Sampler(options)
        self.should_stop = should_stop or (lambda: False)
        self.generated: list[int] = []
        self.pos = 0
        self.stats = Stats()
        # Kernels that run a whole layer per call at decode (pebble_decode_layer), where the source has them.
        self.decode_kernels = getattr(self.layers, "decode_kernels", None)
        self.layer_shape = LayerShape.of(self.cfg) if self.decode_kernels is not None else None

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens through every layer at the current position; float32 logits of the last one."""
        if len(tokens) == 1 and self.decode_kernels is not None:
            return self._decode_step(tokens[0])
        x = embed(self.outer, tokens, self.xp)                                     # [T, n_embd]
        self.layers.begin(self.pos, len(tokens))
        for i in range(self.cfg.n_layer):
            weights, k_cache, v_cache = self.layers.layer(i)
            x = layer_forward(self.cfg, x, weights, k_cache, v_cache, self.pos)
            self.layers.done(i)
        self.pos += len(tokens)
        return to_numpy(output_logits(self.cfg, self.outer, x[-1]))               # [n_vocab]

    def _decode_step(self, token: int) -> np.ndarray:
        """One token through every layer, each layer one native call; the residual stream stays float32."""
        xp, cfg = self.xp, self.cfg
        x = xp.ascontiguousarray(embed(self.outer, [token], xp)[0], dtype=np.float32)     # [n_embd]
        cos, sin = rope_table(cfg, self.layers.n_ctx, xp, np.float32)
        cos, sin = cos[self.pos, 0], sin[self.pos, 0]
        self.layers.begin(self.pos, 1)
        for i in range(cfg.n_layer):
            weights, k_cache, v_cache = self.layers.layer(i)
            self.decode_kernels.decode_layer(self.layer_shape, weights, k_cache, v_cache, self.pos, x, cos, sin)
            self.layers.done(i)
        self.pos += 1
        return to_numpy(output_logits(cfg, self.outer, x.astype(compute_dtype(xp), copy=False)))

    def report(self) -> dict[str, Any] | None:
        """The pebbling report when the layers come from a store, else None."""
        report = getattr(self.layers, "report", None)
        return report(self.stats) if report else None

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """The prompt in chunks of num_batch tokens, so the workspace stays bounded."""
        start = time.perf_counter_ns()
        step = self.options.num_batch
        for i in range(0, len(tokens), step):
            logits = self.forward(tokens[i:i + step])
        self.stats.prompt_tokens += len(tokens)
        self.stats.prompt_ns += time.perf_counter_ns() - start
        return logits

    def decode_one(self, token: int) -> np.ndarray:
        return self.forward([token])

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        return self.sampler(logits, history)

    def tokens(self, prompt: Sequence[int]) -> Iterator[int]:
        """Generated token ids, until end of generation, num_predict or a full context."""
        prompt = list(prompt)
        self._check_prompt(prompt)
        logits = self.prefill(prompt)
        history, limit = prompt, self.options.num_predict
        while limit < 0 or self.stats.generated_tokens < limit:
            start = time.perf_counter_ns()
            token = self.sample(logits, history)
            self.stats.generate_ns += time.perf_counter_ns() - start
            if token in self.model.tokenizer.eog_ids:
                self.stats.done_reason = "stop"
                return
            if self.should_stop():  # checked per token, before the token is used
                self.stats.done_reason = "cancelled"
                return
            self.stats.generated_tokens += 1
            self.generated.append(token)
            history.append(token)
            yield token
            if self.pos >= self.layers.n_ctx or self.stats.generated_tokens == limit:
                break  # no forward pass for a token that will not be sampled
            start = time.perf_counter_ns()
            logits = self.decode_one(token)
            self.stats.generate_ns += time.perf_counter_ns() - start
        self.stats.done_reason = "length"

    def text(self, prompt: Sequence[int]) -> Iterator[str]:
        """Generated text as it comes: whole characters only, cut before the first stop string."""
        decoder = self.model.tokenizer.stream_decoder()
        stops, pending = self.options.stop, ""
        tokens = self.tokens(prompt)
        try:
            for token in tokens:
                pending += decoder.push(token)
                cut = _find_stop(pending, stops)
                if cut is not None:
                    self.stats.done_reason = "stop"
                    pending = pending[:cut]
                    break
                ready = len(pending) - _held_back(pending, stops)
                if ready:
                    yield pending[:ready]
                    pending = pending[ready:]
            else:
                pending += decoder.flush()
                cut = _find_stop(pending, stops)
                if cut is not None:
                    self.stats.done_reason, pending = "stop", pending[:cut]
        finally:
            tokens.close()
        if pending:
            yield pending

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise OptionsError("the prompt is empty: there is nothing to continue from")
        if len(prompt) + self.pos > self.layers.n_ctx:
            raise OptionsError(f"the prompt is {len(prompt)} tokens, more than num_ctx "
                               f"({self.layers.n_ctx}); raise num_ctx (this model was trained on "
                               f"{self.cfg.n_ctx_train}) or shorten the prompt")
        bad = [t for t in prompt if not 0 <= t < self.cfg.n_vocab]
        if bad:
            raise OptionsError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.cfg.n_vocab - 1})")


def generate(model: Model, prompt_tokens: Sequence[int], options: Options | None = None, *,
             layers: LayerSource | None = None, xp: ModuleType = np) -> Iterator[int]:
    """Generated token ids for a tokenized prompt (see ``Generation`` for text and stats)."""
    gen = Generation(model, options or Options(), layers=layers, xp=xp)
    return gen.tokens(prompt_tokens)


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


# ---------------------------------------------------------------------------------------------------
# layers held in a pebble store

WEIGHT_IDS = {f.name: i for i, f in enumerate(fields(LayerWeights))}  # tensor id of each weight
K_ID, V_ID = 16, 17                                                       # ... of the KV cache
_GGML_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}
_ALIGN = 256  # byte alignment of each tensor inside a working slot


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Tensor:
    tensor_id: int
    name: str
    shape: tuple[int, ...]              # numpy order
    nbytes: int
    qtype: int | None = None            # GGUF type of a matrix kept in its file form; None: dense

    def view(self, raw: Array, dtype: np.dtype, kernels) -> Array | QuantWeight:
        """The tensor over `raw`, a flat uint8 array of exactly its bytes."""
        if self.qtype is None:
            return raw.view(dtype).reshape(self.shape)
        return QuantWeight(self.qtype, self.shape, raw.reshape(self.shape[0], -1), kernels)


def _bytes_of(tensor: Array | QuantWeight) -> Array:
    """What the store copies for a tensor: a QuantWeight's bytes, an array itself."""
    return tensor.data if isinstance(tensor, QuantWeight) else tensor


def workspace_bytes(cfg: ModelConfig, n_tokens: int, n_ctx: int, itemsize: int) -> int:
    """Activations of one chunk of n_tokens attending over up to n_ctx positions (an estimate of the
    forward pass's live temporaries: the attention scores, or the MLP, whichever is larger, on top of
    the residual stream and the float32 logits)."""
    T, E, F = n_tokens, cfg.n_embd, cfg.n_ff
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    stream = 4 * T * E * 4                                       # x, normed x and float32 norm temporaries
    attention = 2 * T * (q + 2 * kv) * itemsize + cfg.n_head * T * n_ctx * (8 + itemsize)
    mlp = 5 * T * F * itemsize                                   # gate, up, silu temporaries, product
    return stream + max(attention, mlp) + 2 * cfg.n_vocab * 4


def fused_decode_default() -> bool:
    """Whether decode steps run each layer as one native call unless told: $PEBBLING_FUSED_DECODE=1."""
    return os.environ.get("PEBBLING_FUSED_DECODE", "").strip() == "1"


def adaptive_budget(free: int | None, used, others: int, reserve: float = 0.05) -> int | None:
    """Device bytes an adaptive plan may fill: free memory plus this process's own (`used`, a
    DeviceUse; NVML's whole-device figure when it cannot tell this process's, which then counts for
    nothing), less `others`, what this process's other loaded models hold, less a reserve for
    fragmentation and other users. None when NVML cannot say."""
    if free is None or used is None:
        return None
    mine = used.bytes if used.this_process else 0
    return max(0, int((free + max(0, mine - others)) * (1 - reserve)))


_LIVE: "weakref.WeakSet[PebbledModel]" = weakref.WeakSet()  # every open PebbledModel, for budgets


class PebbledModel:
    """A model whose layers live in a pebble store: saved once to the host tier, in the form the model
    was loaded in (typed pebbles: a matrix in its GGUF type and shape when quantized, the compute type
    when expanded); each request's plan only changes which of them are resident, so a new strategy
    never reads the model file again. The store's backend decides the array module (CuPy on cuda,
    numpy elsewhere) and the kernels that compute from quantized pebbles."""

    def __init__(self, model: Model, *, backend: str | None = None, keep_host_weights: bool = True,
                 fused_decode: bool | None = None):
        """`keep_host_weights=False` hands the model's host layers over to the store: they are
        released as they are saved, so a server holds each layer once, not twice. `fused_decode`: decode
        steps run each layer as one native call (pebble_decode_layer) instead of one array operation at
        a time; None reads $PEBBLING_FUSED_DECODE (1 on, else off)."""
        cfg = model.config
        self.model = model
        self.store = open_store(0, cfg.n_layer, "minimal", backend=backend)
        _LIVE.add(self)
        self.backend = self.store.backend
        if self.backend == "cuda":
            import cupy

            self.xp = cupy
        else:
            self.xp = np
        self.dtype = compute_dtype(self.xp)
        self.weights = model.weights
        self.kernels = kernels_for(self.xp, self.backend)
        self.fused_decode = fused_decode_default() if fused_decode is None else fused_decode
        self.layouts: list[list[_Tensor]] = []
        for i in range(cfg.n_layer):
            lw, layout = model.layers[i], []
            for name, array in lw.arrays():
                if isinstance(array, QuantWeight):
                    data = np.ascontiguousarray(array.data)
                    tensor = _Tensor(WEIGHT_IDS[name], name, array.shape, data.nbytes, array.qtype)
                    desc = _desc(array.qtype, array.shape)
                else:
                    data = np.ascontiguousarray(array, dtype=self.dtype)
                    tensor = _Tensor(WEIGHT_IDS[name], name, data.shape, data.nbytes)
                    desc = _desc(self.dtype, data.shape)
                self.store.save(i, tensor.tensor_id, data, tier="host", desc=desc)
                layout.append(tensor)
            self.layouts.append(layout)
            if not keep_host_weights:
                model.layers[i] = None  # the store's copy is the one that counts from here on
        if not keep_host_weights:
            model.release_layers()
        outer = model.outer_weights(self.xp)
        output = outer.output
        if isinstance(output, QuantWeight):  # computed by this backend's kernels
            output = output.placed(output.data, self.kernels)
        self.outer = OuterWeights(outer.token_embd, outer.output_norm, output)
        self._kv_ctx: int | None = None
        self._overhead: int | None = None

    def close(self) -> None:
        self.store.close()

    def layer_weights(self, i: int) -> LayerWeights:
        """A copy of layer i's weights from the store, in new arrays of the compute module."""
        arrays = {}
        for t in self.layouts[i]:
            arrays[t.name] = t.view(self.xp.empty(t.nbytes, np.uint8), self.dtype, self.kernels)
            self.store.restore(i, t.tensor_id, _bytes_of(arrays[t.name]))
        return LayerWeights(**arrays)

    @property
    def weight_bytes(self) -> int:
        """Every layer's weights as the store holds them."""
        return sum(t.nbytes for layout in self.layouts for t in layout)

    def _expansion_elements(self, n_tokens: int) -> int:
        """fp16 elements of the workspace that a chunk of n_tokens expands quantized matrices into:
        the largest such matrix when the chunk is past what the fused kernels take, else none."""
        if n_tokens <= MAX_VEC:
            return 0
        expanded = [t.shape[0] * t.shape[1] for layout in self.layouts for t in layout
                    if t.qtype is not None and needs_expansion(t.qtype, self.xp)]
        return max(expanded, default=0)

    def kv_shape(self, n_ctx: int) -> tuple[int, int, int]:
        return (n_ctx, self.model.config.n_head_kv, self.model.config.head_dim)

    def memory_model(self, options: Options, prompt_tokens: int | None = None) -> MemoryModel:
        """Device memory for these options; knowing the prompt's length sizes the workspace for the
        chunks and context this request can reach instead of a full num_batch chunk at num_ctx."""
        cfg, isz = self.model.config, self.dtype.itemsize
        kv_token = cfg.kv_bytes_per_token(isz)
        output = self.outer.output
        output_bytes = output.nbytes if isinstance(output, QuantWeight) else output.size * isz
        fixed = output_bytes + (self.outer.output_norm.size + 2 * options.num_ctx * cfg.head_dim) * isz
        # Prefill chunks past the fused kernels also hold the fp16 expansion of a quantized matrix;
        # decode, which multiplies by the quantized bytes, does not (StoreLayers drops it then).
        if prompt_tokens is None:
            chunk = min(options.num_batch, options.num_ctx)
            workspace = workspace_bytes(cfg, chunk, options.num_ctx, isz) + 2 * self._expansion_elements(chunk)
        else:
            chunk = min(options.num_batch, prompt_tokens)
            reach = options.num_ctx if options.num_predict < 0 else prompt_tokens + options.num_predict
            workspace = max(
                workspace_bytes(cfg, chunk, prompt_tokens, isz) + 2 * self._expansion_elements(chunk),
                workspace_bytes(cfg, 1, min(options.num_ctx, reach), isz))          # decode
        return MemoryModel(
            layer_weight_bytes=tuple(sum(_aligned(t.nbytes) for t in layout) for layout in self.layouts),
            layer_kv_bytes=_aligned(options.num_ctx * kv_token // 2) * 2,
            kv_bytes_per_token=kv_token,
            fixed_bytes=fixed,
            workspace_bytes=workspace,
            overhead_bytes=self._overhead_bytes())

    def _overhead_bytes(self) -> int:
        """The backend's own fixed cost: on the GPU, what NVML counts beyond the store's device tier
        and CuPy's pool (the CUDA context, cuBLAS, loaded kernels); 0 on host and stub, which account
        bytes. Measured after a warm-up forward, and never lowered: it only grows as kernels load."""
        if self.backend != "cuda":
            return 0
        if self._overhead is None:
            self._warm_up()
            self._overhead = 0
        pool = self.xp.get_default_memory_pool()
        pool.free_all_blocks()
        used = used_device_memory()
        if used is not None:
            now = used.bytes - pool.total_bytes() - self.store.stats().device_bytes
            self._overhead = max(self._overhead, now)
        return self._overhead

    def _warm_up(self) -> None:
        """A prefill and a decode step of one layer and the output, so that the kernels and library
        handles every request loads are in device memory before the overhead is measured."""
        cfg, xp = self.model.config, self.xp
        weights = self.layer_weights(0)
        n = MAX_VEC + 1  # a chunk past the fused kernels: expansion and GEMM load too
        k, v = (xp.zeros((n + 1, cfg.n_head_kv, cfg.head_dim), self.dtype) for _ in range(2))
        x = layer_forward(cfg, embed(self.outer, list(range(n)), xp), weights, k, v, 0)
        x = layer_forward(cfg, x[-1:], weights, k, v, n)
        output_logits(cfg, self.outer, x[-1]).get()
        del weights, k, v, x
        self.kernels.release_workspace()

    def budget(self, pebbling: PebblingOptions) -> int | None:
        """The request's limit, else (adaptive on a GPU) the device memory this model may use: what is
        free, plus what this process holds, less what the other models it has loaded hold on the
        device (their resident layers stay there while they are loaded)."""
        if pebbling.memory_limit is not None or self.backend != "cuda":
            return pebbling.memory_limit
        from .gpu import free_device_memory

        free, used = free_device_memory(), used_device_memory()
        others = sum(p.device_bytes_held() for p in list(_LIVE) if p is not self and p.backend == "cuda")
        return adaptive_budget(free, used, others)

    def device_bytes_held(self) -> int:
        """Device memory this model holds between requests: its store's device tier and its output
        weights (0 once closed)."""
        if self.store.closed:
            return 0
        output = self.outer.output
        return self.store.stats().device_bytes + (int(output.nbytes) if self.xp is not np else 0)

    def plan(self, options: Options, pebbling: PebblingOptions, prompt_tokens: int | None = None) -> Plan:
        strategy = pebbling.effective_strategy
        budget = self.budget(pebbling) if strategy.name == "adaptive" else pebbling.memory_limit
        return make_plan(self.memory_model(options, prompt_tokens), strategy, budget)

    def layers(self, options: Options, pebbling: PebblingOptions,
               prompt_tokens: int | None = None) -> "StoreLayers":
        """The store-backed layer source for one request (`prompt_tokens`: its prompt's length)."""
        return StoreLayers(self, self.plan(options, pebbling, prompt_tokens), options, pebbling)

    def prepare(self, plan: Plan, n_ctx: int) -> None:
        """Makes the store hold the plan: resident layers on the device, KV entries for n_ctx."""
        store, n_layers = self.store, self.model.config.n_layer
        if self._kv_ctx not in (None, n_ctx):
            for i in range(n_layers):
                store.erase(i, K_ID)
                store.erase(i, V_ID)
            self._kv_ctx = None
        store.set_strategy(plan.strategy, device_limit=plan.store_limit)
        if self._kv_ctx is None:
            zeros = np.zeros(self.kv_shape(n_ctx), self.dtype)  # contents past `pos` are never read
            for i in range(n_layers):
                store.save(i, K_ID, zeros, desc=_desc(self.dtype, zeros.shape))
                store.save(i, V_ID, zeros, desc=_desc(self.dtype, zeros.shape))
            self._kv_ctx = n_ctx
        store.reset_stats()


def _desc(kind: np.dtype | int, shape: tuple[int, ...]):
    """The store's desc of a tensor of numpy `shape`: `kind` a numpy dtype or a GGUF type id."""
    from .store import TensorDesc

    ggml_type = kind if isinstance(kind, int) else _GGML_TYPE[np.dtype(kind)]
    return TensorDesc(ggml_type, tuple(reversed(shape)))


class StoreLayers:
    """A Plan run through the store for one request.

    Resident layers are computed in place from the store's device tier. Streamed layers go through
    working slots: slot n % 2 receives the n-th streamed layer's weights and its KV rows 0..pos while
    the layer before it computes; after it computes, its new KV rows are saved back. On the GPU the
    copies run on a stream of their own and events order them against compute, so no step waits for
    the whole device."""

    def __init__(self, pebbled: PebbledModel, plan: Plan, options: Options, pebbling: PebblingOptions):
        self.pebbled, self.plan, self.pebbling = pebbled, plan, pebbling
        self.store, self.xp, self.dtype = pebbled.store, pebbled.xp, pebbled.dtype
        self.decode_kernels = pebbled.kernels if pebbled.fused_decode else None
        self.n_ctx = options.num_ctx
        self.kv_shape = pebbled.kv_shape(self.n_ctx)
        self.kv_row_bytes = int(np.prod(self.kv_shape[1:])) * self.dtype.itemsize
        pebbled.kernels.release_workspace()
        if self.xp is not np:
            self.xp.get_default_memory_pool().free_all_blocks()  # measure this request, not the last
        pebbled.prepare(plan, self.n_ctx)

        self.resident = {i: self._resident_views(i) for i in plan.resident}
        self.streamed = list(plan.streamed)
        self.order = {layer: n for n, layer in enumerate(self.streamed)}
        slot_bytes = max((self._slot_size(i) for i in self.streamed), default=0)
        self.slots = [self.xp.empty(slot_bytes, np.uint8) for _ in range(plan.n_slots)]
        self.slot_bytes = slot_bytes
        self.in_slot: list[tuple] = [None] * plan.n_slots  # (weights, k, v) of the layer each holds
        if self.xp is not np:
            cuda = self.xp.cuda
            self.copy_stream = cuda.Stream(non_blocking=True)
            self.ready = [cuda.Event(disable_timing=True) for _ in self.slots]
            self.computed = [cuda.Event(disable_timing=True) for _ in self.slots]
        else:
            self.copy_stream = None
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
        kv = _aligned(int(np.prod(self.kv_shape)) * self.dtype.itemsize)
        return sum(_aligned(t.nbytes) for t in self.pebbled.layouts[i]) + 2 * kv

    def _slot_views(self, slot: int, i: int) -> tuple[LayerWeights, Array, Array]:
        buffer, offset, arrays = self.slots[slot], 0, {}

        def carve(nbytes: int) -> Array:
            nonlocal offset
            raw = buffer[offset:offset + nbytes]
            offset += _aligned(nbytes)
            return raw

        for t in self.pebbled.layouts[i]:
            arrays[t.name] = t.view(carve(t.nbytes), self.dtype, self.pebbled.kernels)
        kv_bytes = int(np.prod(self.kv_shape)) * self.dtype.itemsize
        k, v = (carve(kv_bytes).view(self.dtype).reshape(self.kv_shape) for _ in range(2))
        return LayerWeights(**arrays), k, v

    # -- the LayerSource protocol

    def begin(self, pos: int, n_tokens: int) -> None:
        self.pos, self.n_tokens = pos, n_tokens
        if n_tokens <= MAX_VEC:  # the fused kernels take it all: no expanded matrix from here on
            self.pebbled.kernels.release_workspace()
        self.forwards.append((pos, self.store.stats().bytes_restored))
        for n in range(min(len(self.slots), len(self.streamed))):
            self._restore(n)

    def layer(self, i: int) -> tuple[LayerWeights, Array, Array]:
        if i in self.resident:
            return self.resident[i]
        slot = self.order[i] % len(self.slots)
        if self.copy_stream is not None:
            self.xp.cuda.get_current_stream().wait_event(self.ready[slot])
        return self.in_slot[slot]

    def done(self, i: int) -> None:
        if i not in self.order:
            return
        n = self.order[i]
        slot = n % len(self.slots)
        _, k, v = self.in_slot[slot]
        if self.copy_stream is not None:
            self.computed[slot].record(self.xp.cuda.get_current_stream())
            self.copy_stream.wait_event(self.computed[slot])
        rows = slice(self.pos, self.pos + self.n_tokens)
        offset = self.pos * self.kv_row_bytes
        self.store.write(i, K_ID, offset, k[rows], stream=self.copy_stream)
        self.store.write(i, V_ID, offset, v[rows], stream=self.copy_stream)
        if n + len(self.slots) < len(self.streamed):
            self._restore(n + len(self.slots))
        if i == self.streamed[-1]:
            self._sample_memory()

    def _restore(self, n: int) -> None:
        """Restores the n-th streamed layer into slot n % slots (queued on the copy stream)."""
        i, slot = self.streamed[n], n % len(self.slots)
        weights, k, v = views = self._slot_views(slot, i)
        for t in self.pebbled.layouts[i]:
            self.store.restore(i, t.tensor_id, _bytes_of(getattr(weights, t.name)), stream=self.copy_stream)
        if self.pos:
            self.store.read(i, K_ID, 0, k[:self.pos], stream=self.copy_stream)
            self.store.read(i, V_ID, 0, v[:self.pos], stream=self.copy_stream)
        if self.copy_stream is not None:
            self.ready[slot].record(self.copy_stream)
        self.in_slot[slot] = views

    # -- what it cost

    def _sample_memory(self) -> None:
        if self.xp is not np:
            used = used_device_memory()
            if used is not None:
                self.peak_sample = max(self.peak_sample, used.bytes)
                self.measured_by = used.how

    def report(self, stats) -> dict[str, Any]:
        """The `pebbling` object of a final response (DESIGN.md), from this request's store stats."""
        self._sample_memory()
        self.pebbled.kernels.release_workspace()  # the request is over: an idle model holds none
        store = self.store.stats()
        plan, memory = self.plan, self.plan.memory
        if self.xp is not np and self.peak_sample:
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
            "backend": self.pebbled.backend,
            "resident_layers": len(plan.resident),
            "n_layers": memory.n_layers,
            "budget_bytes": plan.budget_bytes,
            "estimated_peak_bytes": plan.estimated_peak_bytes,
            "measured_peak_bytes": int(measured),
            "measured_peak_how": how,
            "bytes_restored": int(store.bytes_restored),
            "restores": int(store.restores),
            "bytes_restored_per_token": (starts[-1] - starts[0]) // decoded if decoded else None,
        }


def _strategy_name(strategy: Strategy) -> str:
    return f"adaptive:{strategy.arg}" if strategy.name == "adaptive" else strategy.name

"""A model whose layers live in a pebble store: the one place where the plan, the store and the model
meet. Its layers are saved once, in the form the model was loaded in; each request's plan only
changes which of them are resident, and `generation()` turns options into a running request.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from ..errors import ClosedError
from ..model import LayerWeights, Model, OuterWeights, QuantWeight, embed, layer_forward, output_logits
from ..model.gguf_file import drop_file_pages
from ..model.qweight import needs_expansion
from ..store import Backend, select_backend
from ..xp import to_numpy
from .constraint import Constraint
from .generation import Generation
from .layout import K_ID, V_ID, WEIGHT_IDS, StoredTensor, aligned, bytes_of, tensor_desc
from .options import Options
from .plan import MemoryModel, PebblingOptions, Plan, make_plan, workspace_bytes
from .store_layers import StoreLayers


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


class PebbledModel:
    """A model whose layers live in a pebble store: saved once to the host tier, in the form the model
    was loaded in (typed pebbles: a matrix in its GGUF type and shape when quantized, the compute type
    when expanded); each request's plan only changes which of them are resident, so a new strategy
    never reads the model file again. The store's backend decides the array module (CuPy on cuda,
    numpy elsewhere) and the kernels that compute from quantized pebbles."""

    def __init__(self, model: Model, *, backend: str | Backend | None = None, keep_host_weights: bool = True,
                 fused_decode: bool | None = None):
        """`keep_host_weights=False` hands the model's host layers over to the store: they are
        released as they are saved, so a server holds each layer once, not twice. `fused_decode`: decode
        steps run each layer as one native call (pebble_decode_layer) instead of one array operation at
        a time; None reads $PEBBLING_FUSED_DECODE (1 on, else off)."""
        cfg = model.config
        self.model = model
        self.backend = select_backend(backend)
        self.store = self.backend.open_store(0, cfg.n_layer, "minimal")
        self.xp, self.dtype = self.backend.xp, self.backend.compute_dtype
        self.weights = model.weights
        self.kernels = self.backend.kernels
        self.fused_decode = fused_decode_default() if fused_decode is None else fused_decode
        self.layouts: list[list[StoredTensor]] = []
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
                self.store.save(i, tensor.tensor_id, data, tier="host", desc=desc)
                if isinstance(array, QuantWeight):
                    drop_file_pages(array.data)  # copied into the store: the file's pages go back
                layout.append(tensor)
            self.layouts.append(layout)
            if not keep_host_weights:
                model.layers[i] = None  # the store's copy is the one that counts from here on
        if not keep_host_weights:
            model.release_layers()
        self.outer: OuterWeights = model.outer_weights(self.kernels)
        self._kv_ctx: int | None = None
        self._overhead: int | None = None

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

    def _expansion_elements(self, n_tokens: int) -> int:
        """fp16 elements of the workspace that a chunk of n_tokens expands quantized matrices into:
        the largest such matrix when the chunk is past what the fused kernels take, else none (and
        none on kernels that multiply prefill chunks from the stored blocks: tiled_matmul)."""
        if n_tokens <= self.kernels.max_vec or self.kernels.tiled_matmul:
            return 0
        expanded = [t.shape[0] * t.shape[1] for layout in self.layouts for t in layout
                    if t.qtype is not None and needs_expansion(t.qtype, self.dtype)]
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
            layer_weight_bytes=tuple(sum(aligned(t.nbytes) for t in layout) for layout in self.layouts),
            layer_kv_bytes=aligned(options.num_ctx * kv_token // 2) * 2,
            kv_bytes_per_token=kv_token,
            fixed_bytes=fixed,
            workspace_bytes=workspace,
            overhead_bytes=self._overhead_bytes())

    def _overhead_bytes(self) -> int:
        """The backend's own fixed cost: on the GPU, what NVML counts beyond the store's device tier
        and CuPy's pool (the CUDA context, cuBLAS, loaded kernels); 0 on host and stub, which account
        bytes. Measured after a warm-up forward, and never lowered: it only grows as kernels load."""
        if not self.backend.measures_memory:
            return 0
        if self._overhead is None:
            self._warm_up()
            self._overhead = 0
        self.backend.free_pool()
        used = self.backend.used_memory()
        if used is not None:
            now = used.bytes - self.backend.pool_bytes() - self.store.stats().device_bytes
            self._overhead = max(self._overhead, now)
        return self._overhead

    def _warm_up(self) -> None:
        """A prefill and a decode step of one layer and the output, so that the kernels and library
        handles every request loads are in device memory before the overhead is measured."""
        cfg, xp = self.model.config, self.xp
        weights = self.layer_weights(0)
        n = self.kernels.max_vec + 1  # a chunk past the fused kernels: expansion and GEMM load too
        k, v = (xp.zeros((n + 1, cfg.n_head_kv, cfg.head_dim), self.dtype) for _ in range(2))
        x = layer_forward(cfg, embed(self.outer, list(range(n)), xp), weights, k, v, 0)
        x = layer_forward(cfg, x[-1:], weights, k, v, n)
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
             others: int = 0) -> Plan:
        """The plan for a request (`prompt_tokens`: its prompt's length; `others`: see `budget`)."""
        strategy = pebbling.effective_strategy
        budget = self.budget(pebbling, others) if strategy.name == "adaptive" else pebbling.memory_limit
        return make_plan(self.memory_model(options, prompt_tokens), strategy, budget)

    def generation(self, options: Options, pebbling: PebblingOptions, prompt_tokens: int | None = None, *,
                   plan: Plan | None = None, others: int = 0, should_stop: Callable[[], bool] | None = None,
                   constraint: Constraint | None = None) -> Generation:
        """One request through the store: its plan (`plan`, else made from the options), the store made
        to hold it, and a Generation over those layers."""
        plan = plan or self.plan(options, pebbling, prompt_tokens, others)
        return Generation(self.model, options, layers=StoreLayers(self, plan, options, pebbling),
                          should_stop=should_stop, constraint=constraint)

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
                store.save(i, K_ID, zeros, desc=tensor_desc(self.dtype, zeros.shape))
                store.save(i, V_ID, zeros, desc=tensor_desc(self.dtype, zeros.shape))
            self._kv_ctx = n_ctx
        store.reset_stats()

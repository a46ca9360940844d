"""Computing from quantized GGUF tensors: dequantize to fp16 (prefill), fused dequantize-and-multiply
matrix-vector products, and the decode step of a whole model in one call.

`Kernels` puts one library of kernels behind the interface the model computes with: the native
library's (native/cuda/, and native/cpu/ in the host library) on `cuda` and `host`, numpy with gguf-py's
decoders on the pure-Python `stub` (stub_kernels.StubKernels, the same arguments accepted and
refused). A backend object makes them (pyplugin.store.backend); nothing here chooses one. Buffers live
in the kernels' array module `xp`: numpy arrays on `host` and `stub`, where a call is done when it
returns; CuPy arrays on `cuda` (host arrays are copied to the device first), the work enqueued on the
current stream.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..errors import InvalidArgumentError, SizeMismatchError
from ..ggml_types import DENSE_TYPES
from ..kv_types import KV_TYPES, cache_kv_type
from ..xp import free_cached
from .abi import ACTIVATIONS, DECODE_WEIGHTS, DECODER_GRAPHS, GATINGS  # noqa: F401 (DECODE_WEIGHTS: for others)
from .interface import as_int

@dataclass(frozen=True)
class LayerShape:
    """struct pebble_layer_shape: what the decode step needs of a model's config."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_dims: int
    rope_neox: int
    rms_eps: float
    activation: int = 0          # 0 SwiGLU, 1 GELU-tanh (the Gemmas), 2 gpt-oss's clamped SwiGLU (its experts)
    ring: int = 0                # the caches are rings of a sliding window's rows
    attn_softcap: float = 0.0    # gemma2's soft cap of the scores; 0: none
    residual_scale: float = 1.0  # Granite's
    n_expert: int = 0            # experts in place of the FFN (pyplugin.model.moe); 0: a dense FFN
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0          # the shared expert's hidden size; 0: none
    expert_norm: int = 0
    expert_scale: float = 1.0
    expert_gating: int = 0       # 0 a softmax over every expert, 1 over the chosen experts' scores (gpt-oss)

    @classmethod
    def of(cls, cfg) -> "LayerShape":
        """From a pyplugin.model.ModelConfig: a layer's own (ModelConfig.for_layer), whose window says
        whether its caches are rings (they hold min(n_ctx, window) rows: ModelConfig.kv_rows)."""
        if cfg.activation not in ACTIVATIONS:
            raise InvalidArgumentError(f"decoder: activation {cfg.activation!r}; {', '.join(ACTIVATIONS)} are "
                                       "computed")
        return cls(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.rope_dims,
                   int(cfg.rope_mode == "neox"), cfg.rms_eps, ACTIVATIONS.index(cfg.activation), int(cfg.window > 0),
                   cfg.attn_softcap, cfg.residual_scale, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp,
                   int(cfg.expert_norm), cfg.expert_scale, GATINGS.index(cfg.expert_gating))


@dataclass(frozen=True)
class StepLayer:
    """struct pebble_step_layer: one layer as a decoder holds it. `weights` maps pebble_layer_weights fields
    to (GGUF type, buffer), absent ones left out; rope_cos and rope_sin are float32 [rope_rows, head_dim]."""

    shape: LayerShape
    weights: dict
    rope_cos: Any
    rope_sin: Any
    kv_rows: int
    attn_scale: float
    # A streamed layer: field name -> the store entry of that weight (its `weights` give the types; their
    # buffers are not read), its caches the entries kv_ids names; copied into the decoder's slots each step.
    streamed: dict | None = None
    # Experts as pebbles: (entry id of expert 0, experts cached), expert j the store entry id + j (its gate,
    # up and down rows; `weights` give their types only); None: the merged tensors of `weights`.
    experts: tuple | None = None


@dataclass(frozen=True)
class StepModel:
    """struct pebble_step_model: what a decoder holds beside its layers."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_seq: int
    kv_type: int
    rms_eps: float
    logit_scale: float
    final_softcap: float
    output_norm: tuple   # (GGUF type, buffer)
    output: tuple
    graphs: bool = True  # capture a batch stepped twice running as a CUDA graph (see pebble_decoder_stats)
    store: Any = None    # the streamed layers' entries (a Store of this library's backend)
    kv_ids: tuple = ()   # per sequence, the (K, V) entry ids of its caches in every layer
    slots: tuple = ()    # the streamed layers' two slots (buffers of the library's memory), or () for its own
    expert_store: Any = None  # the experts' entries (StepLayer.experts), or None for `store`'s
    expert_policy: int = 0    # a cache of experts' victim: EXPERT_POLICIES' index (pebble_step_model)
    expert_prefetch: bool = False  # each layer's router guesses its experts from the hidden state entering it


DECODER_STATS = ("steps", "tokens", "layer_passes", "graphs_captured", "graph_replays", "graphs_dropped",
                 "expert_hits", "expert_misses", "expert_bytes_restored", "expert_guesses", "expert_guesses_right",
                 "expert_prefetches", "expert_prefetch_hits", "expert_device_bytes", "scratch_bytes")
EXPERT_POLICIES = ("lru", "lfu")  # pebble_step_model.expert_policy 0 and 1: least recently / least often used
EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # what experts as pebbles take from the store


class GraphPolicy:
    """When a decode step runs as a CUDA graph (native/cuda/graph.cu's graph_policy, for the backends that have
    no graphs and for the tests): a batch (its sequences in order, and whether it makes logits) stepped twice
    running is captured; a batch that has a graph replays it; any other runs directly. Up to DECODER_GRAPHS
    graphs are kept, the least recently used dropped first."""

    def __init__(self, enabled: bool):
        self.enabled, self.last_direct, self.slots = enabled, None, {}  # slots: key -> last use
        self.clock = self.captured = self.replays = self.dropped = 0

    def decide(self, key) -> str:
        """'direct', 'capture' or 'replay' for a step of this key."""
        self.clock += 1
        if not self.enabled:
            return "direct"
        if key in self.slots:
            self.slots[key] = self.clock
            self.replays += 1
            return "replay"
        if self.last_direct == key:
            if len(self.slots) == DECODER_GRAPHS:
                del self.slots[min(self.slots, key=self.slots.get)]
                self.dropped += 1
            self.last_direct = None
            self.slots[key] = self.clock
            self.captured += 1
            return "capture"
        self.last_direct = key
        return "direct"


def tensor_ref(name: str, t) -> tuple:
    """(GGUF type, buffer) of a QuantWeight or a dense float32/float16 array, as the decoder takes them."""
    if hasattr(t, "qtype"):  # a QuantWeight
        return t.qtype, t.data
    if t.dtype in DENSE_TYPES:
        return DENSE_TYPES[t.dtype], t
    raise InvalidArgumentError(f"decoder: {name} is {t.dtype}; dense weights must be float32 or float16")


class Decoder:
    """A model's decode step as one call (pebble_decoder_*): made once over a plan's weights and caches,
    then `step` runs one token of each of up to n_seq sequences through every layer and the output."""

    def __init__(self, lib_decoder, xp, n_embd: int, n_vocab: int, stream: Callable[[], Any]):
        self._decoder, self.xp, self.n_embd, self.n_vocab, self._stream = lib_decoder, xp, n_embd, n_vocab, stream
        self.calls = 0  # native calls made by steps: one each

    def step(self, seqs, positions, x, logits: bool = True):
        """Token b is sequence seqs[b] at positions[b]; x (float32 [n, n_embd], their embeddings) becomes
        their last hidden states in place. Returns float32 logits [n, n_vocab], or None when not wanted."""
        out = self.xp.empty((len(seqs), self.n_vocab), dtype=np.float32) if logits else None
        self._decoder.step(seqs, positions, x, out, stream=self._stream())
        self.calls += 1
        return out

    def stats(self) -> dict:
        return self._decoder.stats()

    def close(self) -> None:
        self._decoder.close()


class Kernels:
    """A library of kernels (NativeKernels or StubKernels: `lib`), and the array module (`xp`) their
    buffers live in. `current_stream()` gives the stream to enqueue on (None: calls finish on return)."""

    def __init__(self, lib: Any, xp: ModuleType, current_stream: Callable[[], Any] = lambda: None):
        self.lib, self.xp, self._stream = lib, xp, current_stream
        self.name = lib.backend
        self.max_vec: int = lib.MAX_VEC  # the most vectors one matvec call takes
        # Whether a prefill chunk multiplies quantized weights as stored (matmul) rather than expanding
        # them into the fp16 workspace for a GEMM: the host library's tiled kernels beat numpy's GEMM
        # over an expanded matrix; cuBLAS on the GPU, and numpy on the stub, do better with the expansion.
        self.tiled_matmul: bool = lib.backend == "host"
        # Whether a decode step's attention runs through `attend` (one call for every sequence of a batch)
        # rather than array operations per sequence: on host memory (on a GPU not yet timed against CuPy's).
        self.attends: bool = lib.backend in ("host", "stub")
        # Whether float32 vectors go to the library as they are (it rounds them to fp16 with F16C, where numpy's
        # conversion is a scalar loop); CuPy converts them on the GPU.
        self.takes_float32: bool = lib.backend in ("host", "stub")
        self._local = threading.local()  # each thread's fp16 workspace and decode scratch
        self._scratch_bytes: dict[tuple, int] = {}  # (LayerShape, n_ctx) or ("attend", ...) -> scratch bytes

    def __repr__(self) -> str:
        return f"Kernels({self.name!r})"

    def _bytes(self, raw):
        """`raw` as an array in xp's memory: CUDA arrays and numpy arrays as they are (copied to the
        device for cuda), any other buffer (bytes, memoryview, mmap) as uint8."""
        if not (isinstance(raw, np.ndarray) or hasattr(raw, "__cuda_array_interface__")):
            raw = np.frombuffer(raw, dtype=np.uint8)
        return self.xp.asarray(raw)

    def type_block(self, ggml_type) -> tuple[int, int]:
        """(elements, bytes) of one block of `ggml_type` (an id or gguf's GGMLQuantizationType)."""
        return self.lib.type_block(ggml_type)

    def dequantize(self, ggml_type, raw, n_elements: int, *, out=None):
        """The `n_elements` elements of the tensor whose GGUF bytes are `raw`, as a flat float16 array
        (written into `out` when given). Values are decoded in float32 as gguf's dequantize does, then
        rounded to nearest even (out of fp16 range: +-inf)."""
        n_elements = as_int(n_elements, "n_elements")
        if out is None:
            out = self.xp.empty(max(n_elements, 0), dtype=np.float16)
        else:
            _check_out("dequantize", out, np.float16, (n_elements,))
        self.lib.dequantize(ggml_type, self._bytes(raw), n_elements, out, stream=self._stream())
        return out

    def _vectors(self, x):
        """x as the library takes it, C-contiguous: float32 where it rounds float32 vectors to fp16 itself
        (takes_float32), else rounded to fp16 here."""
        x = self.xp.asarray(x)
        if self.takes_float32 and x.dtype == np.float32:
            return self.xp.ascontiguousarray(x)
        return self.xp.ascontiguousarray(x, dtype=np.float16)

    def matvec(self, ggml_type, w, n_rows: int, n_cols: int, x, *, out=None):
        """W @ x for the n_rows x n_cols weight whose GGUF bytes are `w` (rows contiguous, as GGUF
        stores them): x is [n_cols] or [n_vec, n_cols] with n_vec in 1..8, cast to float16; returns
        float32 [n_rows] or [n_vec, n_rows] (written into `out` when given). Products and sums are
        float32."""
        xp = self.xp
        n_rows, n_cols = as_int(n_rows, "n_rows"), as_int(n_cols, "n_cols")
        x = self._vectors(x)
        if x.ndim not in (1, 2) or x.shape[-1] != n_cols:
            raise SizeMismatchError(f"matvec: x must be [n_cols] or [n_vec, n_cols] with n_cols {n_cols}, "
                                    f"got shape {tuple(x.shape)}")
        n_vec = 1 if x.ndim == 1 else x.shape[0]
        shape = (max(n_rows, 0),) if x.ndim == 1 else (n_vec, max(n_rows, 0))
        if out is None:
            out = xp.empty(shape, dtype=np.float32)
        else:
            _check_out("matvec", out, np.float32, shape)
        if x.dtype == np.float32 and 1 <= n_vec <= self.max_vec:  # rounded to fp16 by the library
            self.lib.matmul_f32(ggml_type, self._bytes(w), n_rows, n_cols, x, n_vec, out, stream=self._stream())
        else:
            self.lib.matvec(ggml_type, self._bytes(w), n_rows, n_cols, x.astype(np.float16, copy=False), n_vec, out,
                            stream=self._stream())
        return out

    def matmul(self, ggml_type, w, n_rows: int, n_cols: int, x, *, out=None):
        """As matvec for x [n_vec, n_cols] with any n_vec (pebble_matmul): a prefill chunk multiplied
        from the weights as stored."""
        xp = self.xp
        n_rows, n_cols = as_int(n_rows, "n_rows"), as_int(n_cols, "n_cols")
        x = self._vectors(x)
        if x.ndim != 2 or x.shape[-1] != n_cols:
            raise SizeMismatchError(f"matmul: x must be [n_vec, n_cols] with n_cols {n_cols}, got shape "
                                    f"{tuple(x.shape)}")
        shape = (x.shape[0], max(n_rows, 0))
        if out is None:
            out = xp.empty(shape, dtype=np.float32)
        else:
            _check_out("matmul", out, np.float32, shape)
        call = self.lib.matmul_f32 if x.dtype == np.float32 else self.lib.matmul  # float32: rounded by the library
        call(ggml_type, self._bytes(w), n_rows, n_cols, x, x.shape[0], out, stream=self._stream())
        return out

    def workspace(self, n_elements: int):
        """A flat float16 array of n_elements, a view of this thread's reused workspace (kept until
        `release_workspace`); it grows to the largest size asked for, the old one given back first:"""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.size < n_elements:
            self._local.buffer = None  # to the device, from CuPy's pool too (NVML counts what it keeps)
            free_cached(self.xp)
            buffer = self._local.buffer = self.xp.empty(n_elements, dtype=np.float16)
        return buffer[:n_elements]

    def release_workspace(self) -> None:
        """Drops this thread's workspace (a request that needs one allocates it again)."""
        self._local.buffer = None

    def decoder(self, cfg, layers, caches, outer, n_ctx: int, *, streamed=None, store=None, kv_ids=(),
                slots=(), experts=None, expert_store=None, expert_policy: str = "lru",
                expert_prefetch: bool = False) -> Decoder:
        """The decode step of a model over these weights and caches (pebble_decoder_create): `cfg` its
        ModelConfig, `layers` each layer's LayerWeights, caches[i][s] layer i's (K, V) of sequence s (each
        [rows, n_head_kv, head_dim] in a KV type: kv_types.py), `outer` its OuterWeights, `n_ctx` the context its
        RoPE tables cover. Every array must live as long as the decoder; the Decoder keeps them.
        `streamed`: {layer: {field: entry id}} for the layers copied from `store` into the decoder's slots
        each step (their `layers` and `caches` give types and shapes only), each sequence's caches the
        entries kv_ids[s] = (K id, V id); `slots` the two buffers they are copied into (equal sizes), or ()
        for the decoder to make its own. `experts`: {layer: (ids, experts cached)} for layers whose experts
        are pebbles (their merged matrices in `layers` give types only): ids the entry of expert 0, an entry
        each, of `expert_store` or else `store` (experts_stored 1), or the entries of the merged gate, up and
        down tensors in `store` (2); `expert_policy` and `expert_prefetch` as pebble_step_model has them."""
        from ..model.transformer import rope_table  # noqa: PLC0415 - the store sits below the model
        if cfg.v_norm:  # Gemma 4 (model.gemma4.forward_decodes): its parts are not in pebble_decoder_step yet
            raise InvalidArgumentError(f"decoder: a {cfg.arch} model's decode step runs through the forward pass")
        kv_type = _kv_type("decoder", caches[0][0][0], cfg.head_dim)
        step_layers = []
        for i, lw in enumerate(layers):
            lcfg = cfg.for_layer(i)
            cos, sin = (self.xp.ascontiguousarray(t.reshape(n_ctx, -1)) for t in rope_table(lcfg, n_ctx, self.xp,
                                                                                           np.float32))
            rows = caches[i][0][0].shape[0]
            if lcfg.window and rows > lcfg.window:
                raise InvalidArgumentError(f"decoder: layer {i} slides over {lcfg.window} positions, so its caches "
                                           f"hold that many rows (a ring), not {rows}")
            stored = (experts or {}).get(i)
            if stored is not None and isinstance(stored[0], tuple) and len(stored[0]) != len(EXPERT_MATRICES):
                raise InvalidArgumentError(f"decoder: layer {i}: experts read from merged tensors need the entries of "
                                           f"{', '.join(EXPERT_MATRICES)}; got {len(stored[0])}")
            refs = {name: tensor_ref(name, getattr(lw, name)) for name in DECODE_WEIGHTS if getattr(lw, name) is not None}
            if stored is not None:  # types only: the experts come from the store
                refs.update({name: (refs[name][0], None) for name in EXPERT_MATRICES if name in refs})
            step_layers.append(StepLayer(LayerShape.of(lcfg), refs, cos, sin, rows, float(np.float32(lcfg.query_scale)),
                                         (streamed or {}).get(i), None if stored is None else tuple(stored)))
        output_norm = self.xp.ascontiguousarray(outer.output_norm, dtype=np.float32)
        model = StepModel(cfg.n_layer, cfg.n_embd, cfg.n_vocab, len(caches[0]), kv_type, cfg.rms_eps,
                          float(cfg.logit_scale), float(cfg.final_softcap), tensor_ref("output_norm", output_norm),
                          tensor_ref("output", outer.output),
                          graphs=os.environ.get("PEBBLING_CUDA_GRAPHS", "1") != "0", store=store,
                          kv_ids=tuple(tuple(pair) for pair in kv_ids), slots=tuple(slots), expert_store=expert_store,
                          expert_policy=EXPERT_POLICIES.index(expert_policy), expert_prefetch=bool(expert_prefetch))
        k_caches = [k for per_layer in caches for k, _ in per_layer]
        v_caches = [v for per_layer in caches for _, v in per_layer]
        return Decoder(self.lib.decoder(model, step_layers, k_caches, v_caches), self.xp, cfg.n_embd, cfg.n_vocab,
                       self._stream)

    def attend(self, q, caches, n_pos, n_head_kv: int, scale: float, softcap: float = 0.0, new=None):
        """Attention of one query per sequence over its own cache (pebble_attend): q [B, n_head, head_dim]
        (rotated, not yet scaled), caches B (k, v) pairs [rows, n_head_kv, width] of one KV type
        (float32 or float16), n_pos the rows each attends over. `new`: the new tokens' (k, v) rows
        [B, n_head_kv, head_dim], written into row n_pos[b] - 1 of each sequence's caches first (None: the
        rows are already there). Returns float32 [B, n_head * head_dim]; each row is the same whatever
        the others."""
        xp = self.xp
        q = xp.ascontiguousarray(q, dtype=np.float32)
        n_seq, n_head, head_dim = q.shape
        n_rows = caches[0][0].shape[0]
        kv_type = _kv_type("attend", caches[0][0], head_dim)
        rows = {}
        if new is not None:
            rows = {name: xp.ascontiguousarray(a, dtype=np.float32).reshape(n_seq, -1)
                    for name, a in zip(("k_new", "v_new"), new)}
        need = self._scratch_bytes.get(("attend", n_seq, n_head, n_rows))
        if need is None:  # asked once per batch size and cache length: a decode step attends every layer
            need = self._scratch_bytes["attend", n_seq, n_head, n_rows] = self.lib.attend_scratch_bytes(n_seq, n_head,
                                                                                                          n_rows)
        scratch = getattr(self._local, "attend_scratch", None)
        if scratch is None or scratch.nbytes < need:
            scratch = self._local.attend_scratch = xp.empty(max(need, 1), dtype=np.uint8)
        out = xp.empty((n_seq, n_head * head_dim), dtype=np.float32)
        self.lib.attend(q.reshape(n_seq, n_head * head_dim), kv_type, [k for k, _ in caches], [v for _, v in caches],
                        n_pos, n_rows, n_head, n_head_kv, head_dim, float(scale), float(softcap), out,
                        scratch[:max(need, 1)], stream=self._stream(), **rows)
        return out

    def attend_prompt(self, q, cache, pos: int, n_head_kv: int, scale: float, softcap: float = 0.0,
                      window: int = 0, sinks=None):
        """Causal attention of a prompt chunk (pebble_attend_prompt): q [T, n_head, head_dim] (rotated, not
        yet scaled) at positions pos..pos + T - 1 over rows 0..pos + T - 1 of one sequence's (k, v) caches
        [rows, n_head_kv, width] (its own rows already written); a query sees the keys at and before it,
        within `window` of it where window > 0; `sinks` [n_head] (gpt-oss) join each head's softmax. Returns
        float32 [T, n_head * head_dim]."""
        xp = self.xp
        q = xp.ascontiguousarray(q, dtype=np.float32)
        n_tok, n_head, head_dim = q.shape
        k_cache, v_cache = cache
        kv_type = _kv_type("attend_prompt", k_cache, head_dim)
        out = xp.empty((n_tok, n_head * head_dim), dtype=np.float32)
        self.lib.attend_prompt(q.reshape(n_tok, n_head * head_dim), kv_type, k_cache, v_cache, int(pos),
                               k_cache.shape[0], n_head, n_head_kv, head_dim, int(window), float(scale),
                               float(softcap), out, stream=self._stream(),
                               sinks=None if sinks is None else xp.ascontiguousarray(sinks, dtype=np.float32))
        return out

def _kv_type(call: str, cache, head_dim: int) -> int:
    """The GGUF type id of a cache's KV type (kv_types.py), or an error naming what was seen."""
    try:
        return cache_kv_type(cache, head_dim).ggml_type
    except ValueError as exc:
        raise InvalidArgumentError(f"{call}: {exc}; accepted: float16 (f16), float32 (f32), or uint8 blocks of "
                                   f"{' or '.join(t.name for t in KV_TYPES.values() if t.quantized)}") from None


def _check_out(call: str, out, dtype, shape: tuple) -> None:
    if out.dtype != dtype:
        raise InvalidArgumentError(f"{call}: out must be {np.dtype(dtype)}, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise SizeMismatchError(f"{call}: out must have shape {shape}, got {tuple(out.shape)}")

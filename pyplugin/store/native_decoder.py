"""The native library's decode step of a whole model (pebble_decoder_create, pebble_decoder_step): a
NativeDecoder packs a StepModel and its StepLayers (store/kernels.py) into the C structs, checks each
buffer's size against the shapes (the library cannot see them) and keeps every buffer alive with it.
"""

from __future__ import annotations

from ..errors import ClosedError, InvalidArgumentError, PebblingError, SizeMismatchError
from .interface import stream_pointer
from .kernels import DECODE_WEIGHTS, DECODER_STATS, EXPERT_MATRICES
from .native import _check, ffi
from .native_buffers import _ITEMSIZE, _c_type, _int32, _kv_bytes, _pointer


class NativeDecoder:
    """A pebble_decoder_t and every buffer it names, kept alive with it."""

    def __init__(self, kernels, model, layers, k_caches, v_caches):
        lib, backend = kernels._lib, kernels.backend
        self._lib, self._backend, self._keep = lib, backend, []
        if len(layers) != model.n_layer or len(k_caches) != model.n_layer * model.n_seq or \
                len(v_caches) != len(k_caches):
            raise SizeMismatchError(f"decoder: {len(layers)} layers and {len(k_caches)} K / {len(v_caches)} V caches; "
                                    f"{model.n_layer} layers of {model.n_seq} sequences need "
                                    f"{model.n_layer * model.n_seq} of each")
        c_layers, checked = ffi.new("struct pebble_step_layer[]", len(layers)), []
        for i, (layer, c) in enumerate(zip(layers, c_layers)):
            shape = layer.shape
            for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "rope_dims", "rope_neox", "rms_eps",
                         "activation", "ring", "attn_softcap", "residual_scale", "n_expert", "n_expert_used",
                         "n_ff_exp", "n_ff_shexp", "expert_norm", "expert_scale", "expert_gating", "kv_layer", "v_norm"):
                setattr(c.shape, name, getattr(shape, name))
            # Sizes follow from a shape the library takes; another it refuses by name, with its own message.
            valid = min(shape.n_embd, shape.n_head, shape.n_head_kv, shape.head_dim, shape.n_ff) >= 1 and \
                shape.n_head % shape.n_head_kv == 0
            sizes = decode_buffer_sizes(shape, kernels.type_block, model.n_embd_per_layer) if valid else {}
            checked.append(valid)
            if layer.streamed is not None:  # types here; the entries' sizes are the library's to check
                c.streamed = 1
                ids = dict.fromkeys(DECODE_WEIGHTS, -1) | dict(layer.streamed)
                for f, name in enumerate(DECODE_WEIGHTS):
                    c.weight_ids[f] = _int32(ids[name], f"layer {i} {name}'s entry")
            if layer.experts is not None:  # (expert 0's entry, or the merged gate, up and down's; experts cached)
                ids, cache = layer.experts
                c.experts_stored = 2 if isinstance(ids, tuple) else 1
                c.expert_cache = _int32(cache, f"layer {i}'s expert_cache")
                for name, tid in zip(EXPERT_MATRICES, ids if isinstance(ids, tuple) else (), strict=False):
                    c.weight_ids[DECODE_WEIGHTS.index(name)] = _int32(tid, f"layer {i} {name}'s entry")
                if not isinstance(ids, tuple):
                    c.expert_ids = _int32(ids, f"layer {i}'s expert_ids")
            for name, (ggml_type, buffer) in layer.weights.items():
                if layer.streamed is not None or buffer is None:
                    getattr(c.weights, name).ggml_type = _c_type(ggml_type)
                    continue
                ptr, nbytes = self._pointer(buffer, False, f"layer {i} {name}")
                want = sizes[name](_c_type(ggml_type)) if name in sizes else None
                if want is not None and nbytes != want:
                    raise SizeMismatchError(f"decoder: layer {i}: {name} holds {nbytes} bytes; GGUF type {ggml_type} "
                                            f"needs {want} for this shape")
                field = getattr(c.weights, name)
                field.ggml_type, field.data = _c_type(ggml_type), ptr
            for what, table in (("rope_cos", layer.rope_cos), ("rope_sin", layer.rope_sin)):
                ptr, nbytes = self._pointer(table, False, f"layer {i} {what}")
                if nbytes % (4 * shape.head_dim) or nbytes == 0:
                    raise SizeMismatchError(f"decoder: layer {i}: {what} holds {nbytes} bytes; whole rows of "
                                            f"{shape.head_dim} float32 are needed")
                setattr(c, what, ffi.cast("const float *", ptr))
                c.rope_rows = nbytes // (4 * shape.head_dim)
            c.kv_rows, c.attn_scale = layer.kv_rows, layer.attn_scale
        caches = []
        for name, arrays in (("k_cache", k_caches), ("v_cache", v_caches)):
            pointers = []
            for n, cache in enumerate(arrays):
                i = n // model.n_seq
                if layers[i].streamed is not None or layers[i].shape.kv_layer >= 0:  # in a slot of the decoder's, or
                    pointers.append(ffi.NULL)                                   # its source's (Gemma 4): not read
                    continue
                ptr, nbytes = self._pointer(cache, True, f"layer {i} {name}")
                want = None if not checked[i] else \
                    _kv_bytes(model.kv_type, layers[i].kv_rows * layers[i].shape.n_head_kv, layers[i].shape.head_dim)
                if want is not None and nbytes != want:
                    raise SizeMismatchError(f"decoder: layer {i}: a {name} holds {nbytes} bytes; {want} are needed")
                pointers.append(ffi.cast("void *", ptr))
            caches.append(ffi.new("void *[]", pointers))
        c_model = ffi.new("struct pebble_step_model *")
        for name in ("n_layer", "n_embd", "n_vocab", "n_seq", "kv_type", "rms_eps", "logit_scale", "final_softcap",
                     "n_embd_per_layer"):
            setattr(c_model, name, getattr(model, name))
        c_model.graphs = 1 if model.graphs else 0
        c_model.expert_policy, c_model.expert_prefetch = model.expert_policy, int(model.expert_prefetch)
        if any(layer.experts is not None for layer in layers):
            for name, store in (("store", model.store), ("expert_store", model.expert_store)):
                if store is not None:
                    setattr(c_model, name, store._live())
                    self._keep.append(store)
        if any(layer.streamed is not None for layer in layers):
            if model.store is None or len(model.kv_ids) != model.n_seq:
                raise InvalidArgumentError(f"decoder: streamed layers need the store and the (K, V) entries of each "
                                           f"of {model.n_seq} sequences; got {len(model.kv_ids)}")
            c_model.store = model.store._live()
            kv_ids = ffi.new("int32_t[]", [_int32(t, "a KV entry") for pair in model.kv_ids for t in pair])
            c_model.kv_ids = kv_ids
            self._keep += [kv_ids, model.store]
            for k, slot in enumerate(model.slots[:2]):
                ptr, nbytes = self._pointer(slot, True, f"slot {k}")
                c_model.slots[k] = ffi.cast("void *", ptr)
                c_model.slot_bytes = nbytes if k == 0 else min(c_model.slot_bytes, nbytes)
        norm_type, norm = model.output_norm
        ptr, nbytes = self._pointer(norm, False, "output_norm")
        if norm_type in _ITEMSIZE and nbytes != model.n_embd * _ITEMSIZE[norm_type]:
            raise SizeMismatchError(f"decoder: output_norm holds {nbytes} bytes; {model.n_embd} elements are needed")
        c_model.output_norm.ggml_type, c_model.output_norm.data = _c_type(norm_type), ptr
        out_type, output = model.output
        ptr, nbytes = self._pointer(output, False, "output")
        try:
            elements, block_bytes = kernels.type_block(out_type)
        except PebblingError:
            elements = block_bytes = None  # the library refuses the type, with its own message
        if elements and model.n_embd % elements == 0 and nbytes != model.n_vocab * model.n_embd // elements * block_bytes:
            raise SizeMismatchError(f"decoder: output holds {nbytes} bytes; {model.n_vocab} rows of {model.n_embd} "
                                    f"of GGUF type {out_type} need {model.n_vocab * model.n_embd // elements * block_bytes}")
        c_model.output.ggml_type, c_model.output.data = _c_type(out_type), ptr
        handle = ffi.new("pebble_decoder_t *")
        _check(lib, lib.pebble_decoder_create(c_model, c_layers, caches[0], caches[1], handle))
        self._handle = ffi.gc(handle[0], lib.pebble_decoder_free)
        self._keep += [c_layers, caches, c_model, layers, list(k_caches), list(v_caches), model]
        self._stats = ffi.new("struct pebble_decoder_stats *")

    def _pointer(self, obj, writable: bool, name: str):
        ptr, nbytes = _pointer(obj, self._backend, writable, name)
        self._keep.append(obj)
        return ptr, nbytes

    def step(self, seqs, positions, x, logits, *, stream=None) -> None:
        if self._handle is None:
            raise ClosedError("pebble_decoder_step: the decoder was freed or never made")
        n = len(seqs)
        if len(positions) != n:
            raise SizeMismatchError(f"decoder step: {n} sequences but {len(positions)} positions")
        x_ptr, x_bytes = _pointer(x, self._backend, True, "x")
        model = self._keep[-1]
        width = model.n_embd + model.n_layer * model.n_embd_per_layer  # the per-layer inputs after x (Gemma 4's)
        if 1 <= n <= model.n_seq and x_bytes != 4 * n * width:  # another count: the library's refusal
            raise SizeMismatchError(f"decoder step: x holds {x_bytes} bytes; {n} float32 rows of {model.n_embd} "
                                    f"and their per-layer inputs need {4 * n * width}")
        out_ptr = ffi.NULL
        if logits is not None:
            out_ptr, out_bytes = _pointer(logits, self._backend, True, "logits")
            if out_bytes != 4 * n * model.n_vocab:
                raise SizeMismatchError(f"decoder step: logits hold {out_bytes} bytes; {n} float32 rows of "
                                        f"{model.n_vocab} need {4 * n * model.n_vocab}")
        _check(self._lib, self._lib.pebble_decoder_step(
            self._handle, n, ffi.new("int32_t[]", [int(s) for s in seqs]),
            ffi.new("int64_t[]", [int(p) for p in positions]), ffi.cast("float *", x_ptr),
            ffi.cast("float *", out_ptr), ffi.cast("void *", stream_pointer(stream))))

    def stats(self) -> dict:
        if self._handle is None:
            raise ClosedError("pebble_decoder_stats: the decoder was freed or never made")
        _check(self._lib, self._lib.pebble_decoder_stats(self._handle, self._stats))
        return {name: int(getattr(self._stats, name)) for name in DECODER_STATS}

    def close(self) -> None:
        """Frees the decoder now (the buffers it named are the caller's)."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            ffi.release(handle)  # runs its destructor, pebble_decoder_free, now
        self._keep = []



def decode_buffer_sizes(shape, type_block, n_embd_per_layer: int = 0) -> dict:
    """For each weight of a layer, a function of its GGUF type giving the bytes its buffer must hold."""
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    e, ff = shape.n_embd, shape.n_ff
    E, fx, sh = shape.n_expert, shape.n_ff_exp, shape.n_ff_shexp

    def matrix(rows, cols):
        def size(ggml_type):
            try:
                elements, nbytes = type_block(ggml_type)
            except PebblingError:
                return None
            return rows * (cols // elements) * nbytes if cols % elements == 0 else None
        return size

    def vector(n):
        return lambda ggml_type: n * _ITEMSIZE[ggml_type] if ggml_type in _ITEMSIZE else None

    return {"attn_norm": vector(e), "wq": matrix(q, e), "wk": matrix(kv, e), "wv": matrix(kv, e),
            "wo": matrix(e, q), "ffn_norm": vector(e), "w_gate": matrix(ff, e), "w_up": matrix(ff, e),
            "w_down": matrix(e, ff), "bq": vector(q), "bk": vector(kv), "bv": vector(kv),
            "q_norm": vector(shape.head_dim), "k_norm": vector(shape.head_dim), "post_attn_norm": vector(e),
            "post_ffn_norm": vector(e), "ffn_gate_inp": matrix(E, e), "ffn_gate_exps": matrix(E * fx, e),
            "ffn_up_exps": matrix(E * fx, e), "ffn_down_exps": matrix(E * e, fx), "ffn_gate_inp_shexp": vector(e),
            "ffn_gate_shexp": matrix(sh, e), "ffn_up_shexp": matrix(sh, e), "ffn_down_shexp": matrix(e, sh),
            "attn_sinks": vector(shape.n_head), "bo": vector(e), "ffn_gate_inp_b": vector(E),
            "ffn_gate_exps_b": vector(E * fx), "ffn_up_exps_b": vector(E * fx), "ffn_down_exps_b": vector(E * e),
            **({"per_layer_inp_gate": matrix(n_embd_per_layer, e), "per_layer_proj": matrix(e, n_embd_per_layer)}
               if n_embd_per_layer > 0 else {}),  # else the library refuses them, by name
            "per_layer_post_norm": vector(e), "out_scale": vector(1), "ffn_gate_inp_s": vector(e),
            "ffn_pre_norm_2": vector(e), "ffn_post_norm_1": vector(e), "ffn_post_norm_2": vector(e),
            "ffn_down_exps_s": vector(E)}

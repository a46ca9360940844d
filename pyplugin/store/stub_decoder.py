"""The stub backend's decode step: pebble_decoder_*'s semantics, the model's own forward pass
(pyplugin.model.transformer) run on the stub's kernels, every matrix multiplied from its GGUF bytes as the
native step does, streamed layers copied through the store as the native step copies them.
"""

from __future__ import annotations

import numpy as np

from ..errors import ClosedError, InvalidArgumentError, SizeMismatchError
from ..ggml_types import DENSE_TYPES
from ..kv_types import KV_BY_GGML
from ..model.transformer import (ROPE_NEOX, ROPE_NORMAL, LayerWeights, ModelConfig, OuterWeights, attention_block,
                                 ffn_block, layer_tail, output_logits)
from .abi import DECODER_MAX_BATCH
from .decoder_scratch import scratch_bytes
from .interface import host_buffer
from .kernels import ACTIVATIONS, DECODER_STATS, EXPERT_MATRICES, GATINGS, GraphPolicy
from .stub_experts import ExpertSlots

_DTYPE_OF = {ggml_type: dtype for dtype, ggml_type in DENSE_TYPES.items()}  # F32, F16 -> numpy dtype


class StubDecoder:
    """pebble_decoder_*'s semantics: the model's forward pass (transformer.layer_forward, then the output
    norm and projection) for each token of a step, over the weights and caches named once, with the same
    arguments accepted and refused as native/cuda/decoder.cu."""

    def __init__(self, kernels, model, layers, k_caches, v_caches):
        fn = "pebble_decoder_create"
        self.max_rows = kernels.MAX_VEC  # rows a matrix takes at once: each as alone (stub_kernels. matvec)
        stored = {}  # layer -> what ExpertSlots takes, where its experts are pebbles
        if min(model.n_layer, model.n_embd, model.n_vocab, model.n_seq) < 1 or model.n_seq > DECODER_MAX_BATCH:
            raise InvalidArgumentError(f"{fn}: n_layer {model.n_layer}, n_embd {model.n_embd} and n_vocab "
                                       f"{model.n_vocab} must each be at least 1, n_seq {model.n_seq} within "
                                       f"1..{DECODER_MAX_BATCH}")
        if len(layers) != model.n_layer or len(k_caches) != model.n_layer * model.n_seq or \
                len(v_caches) != len(k_caches):
            raise SizeMismatchError(f"decoder: {len(layers)} layers and {len(k_caches)} K / {len(v_caches)} V caches; "
                                    f"{model.n_layer} layers of {model.n_seq} sequences need "
                                    f"{model.n_layer * model.n_seq} of each")
        kv = KV_BY_GGML.get(model.kv_type)
        if kv is None:
            raise InvalidArgumentError(f"{fn}: kv_type {model.kv_type}; the caches must be 0 F32, 1 F16, 8 Q8_0 or "
                                       "2 Q4_0")
        self.model, self.layers, self.stats_ = model, [], dict.fromkeys(DECODER_STATS, 0)
        self.streamed = {}  # layer -> (buffers by field, entries by field, caches by sequence): pebble.h's slots
        if any(layer.streamed is not None for layer in layers):
            if model.store is None or len(model.kv_ids) != model.n_seq:
                raise InvalidArgumentError(f"decoder: streamed layers need the store and the (K, V) entries of each "
                                           f"of {model.n_seq} sequences; got {len(model.kv_ids)}")
        self.graphs = GraphPolicy(bool(model.graphs) and not any(layer.streamed is not None for layer in layers))
        self.stats_["scratch_bytes"] = scratch_bytes([layer.shape for layer in layers], [layer.kv_rows for layer in layers],
                                                     model.n_seq, model.n_embd, model.n_vocab, on_device=False,
                                                     n_embd_per_layer=model.n_embd_per_layer)
        for i, layer in enumerate(layers):
            where, s = f"{fn}: layer {i}", layer.shape
            kernels._check_shape(where, s, layer.kv_rows)
            e, q_rows, kv_rows = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
            w = layer.weights
            if layer.streamed is not None:  # buffers the step restores the entries into
                w, entries = {}, {}
                for name, tensor_id in layer.streamed.items():
                    nbytes = model.store.entry_info(i, tensor_id).nbytes
                    w[name] = (layer.weights[name][0], np.zeros(nbytes, np.uint8))
                    entries[name] = tensor_id
            def build(w, where=where, s=s, e=e, q_rows=q_rows, kv_rows=kv_rows) -> LayerWeights:
                vec = lambda *a, **k: kernels._vector(where, w, *a, **k)  # noqa: E731
                mat = lambda *a: kernels._matrix(where, w, *a)  # noqa: E731
                dense, reader = not s.n_expert or _given(w, "w_gate"), s.kv_layer >= 0  # (Gemma 4's: both)
                mat_if = lambda wanted, name, *a: mat(name, *a) if _wanted(where, w, name, wanted) else None  # noqa: E731
                gemma4 = _gemma4_weights(where, w, s, model.n_embd_per_layer, vec, mat)
                E, fx, sh = s.n_expert, s.n_ff_exp, s.n_ff_shexp if s.n_expert else 0
                merged = E and layer.experts is None  # else the experts are entries of the store
                experts = dict(
                    ffn_gate_inp=mat_if(E, "ffn_gate_inp", E, e), ffn_gate_exps=mat_if(merged, "ffn_gate_exps", E * fx, e),
                    ffn_up_exps=mat_if(merged, "ffn_up_exps", E * fx, e),
                    ffn_down_exps=mat_if(merged, "ffn_down_exps", E * e, fx),
                    ffn_gate_inp_shexp=vec("ffn_gate_inp_shexp", e) if _wanted(where, w, "ffn_gate_inp_shexp", sh) else None,
                    ffn_gate_shexp=mat_if(sh, "ffn_gate_shexp", sh, e), ffn_up_shexp=mat_if(sh, "ffn_up_shexp", sh, e),
                    ffn_down_shexp=mat_if(sh, "ffn_down_shexp", e, sh))
                return LayerWeights(
                    attn_norm=vec("attn_norm", e), wq=mat("wq", q_rows, e), wk=mat_if(not reader, "wk", kv_rows, e),
                    wv=mat_if(not reader and _given(w, "wv"), "wv", kv_rows, e), wo=mat("wo", e, q_rows),
                    ffn_norm=vec("ffn_norm", e), **gemma4,
                    w_gate=mat_if(dense, "w_gate", s.n_ff, e), w_up=mat_if(dense, "w_up", s.n_ff, e),
                    w_down=mat_if(dense, "w_down", e, s.n_ff), **experts,
                    bq=vec("bq", q_rows, optional=True), bk=vec("bk", kv_rows, optional=True),
                    bv=vec("bv", kv_rows, optional=True), q_norm=vec("q_norm", s.head_dim, optional=True),
                    k_norm=vec("k_norm", s.head_dim, optional=True),
                    post_attn_norm=vec("post_attn_norm", e, optional=True),
                    post_ffn_norm=vec("post_ffn_norm", e, optional=True), **_gpt_oss_weights(where, w, s, vec))

            lw = build(w)
            if (lw.q_norm is not None or lw.k_norm is not None) and (lw.bq is not None or lw.bk is not None):
                raise InvalidArgumentError(f"{where}: Q/K norms together with Q/K biases are not supported")
            if s.n_embd != model.n_embd:
                raise SizeMismatchError(f"{fn}: layer {i} is {s.n_embd} wide; the model is {model.n_embd}")
            cos, sin = (np.frombuffer(host_buffer(t, writable=False, what="decoder rope"), np.float32)
                        .reshape(-1, 1, s.head_dim) for t in (layer.rope_cos, layer.rope_sin))
            if s.head_dim % kv.block:
                raise InvalidArgumentError(f"{fn}: layer {i}: head_dim {s.head_dim} is not a multiple of {kv.block}, "
                                           f"which {kv.name.upper()} caches need")
            shape = kv.shape(layer.kv_rows, s.n_head_kv, s.head_dim)
            caches = []
            for seq in range(model.n_seq if s.kv_layer < 0 else 0):
                pair = []
                if layer.streamed is not None:
                    for kind, tensor_id in zip("KV", model.kv_ids[seq]):
                        want = int(np.prod(shape)) * kv.dtype.itemsize
                        if model.store.entry_info(i, tensor_id).nbytes != want:
                            raise SizeMismatchError(f"{fn}: layer {i}: sequence {seq}'s {kind} cache (tensor "
                                                    f"{tensor_id}) is not an entry of {want} bytes")
                        pair.append(np.zeros(shape, kv.dtype))
                    caches.append(tuple(pair))
                    continue
                for name, arrays in (("k_cache", k_caches), ("v_cache", v_caches)):
                    c = np.frombuffer(host_buffer(arrays[i * model.n_seq + seq], writable=True, what="decoder cache"),
                                      kv.dtype)
                    want = int(np.prod(shape))
                    if c.size != want:
                        raise SizeMismatchError(f"decoder: layer {i}: a {name} holds {c.nbytes} bytes; "
                                                f"{want * c.itemsize} are needed")
                    pair.append(c.reshape(shape))
                caches.append(tuple(pair))
            cfg = ModelConfig(arch="decoder", n_layer=1, n_embd=e, n_head=s.n_head, n_head_kv=s.n_head_kv,
                              head_dim=s.head_dim, n_ff=s.n_ff, n_vocab=0, n_ctx_train=layer.kv_rows,
                              rms_eps=s.rms_eps, rope_mode=ROPE_NEOX if s.rope_neox else ROPE_NORMAL,
                              rope_dims=s.rope_dims, attn_scale=float(layer.attn_scale),
                              activation=ACTIVATIONS[s.activation], window=layer.kv_rows if s.ring else 0,
                              attn_softcap=float(s.attn_softcap), residual_scale=float(s.residual_scale),
                              n_expert=s.n_expert, n_expert_used=s.n_expert_used, n_ff_exp=s.n_ff_exp,
                              n_ff_shexp=s.n_ff_shexp if s.n_expert else 0, expert_norm=bool(s.expert_norm),
                              expert_scale=float(s.expert_scale), expert_gating=GATINGS[s.expert_gating],
                              v_norm=bool(s.v_norm), kv_from=s.kv_layer)
            if s.kv_layer >= 0:  # Gemma 4: attends over an earlier layer's caches (its own entries are not read)
                caches = _source_caches(fn, i, layer, layers, self.layers)
            self.layers.append((cfg, lw, caches, (cos, sin), layer))
            if layer.experts is not None:
                types = {name: layer.weights[name][0] for name in EXPERT_MATRICES if name in layer.weights}
                if len(types) < len(EXPERT_MATRICES):
                    raise InvalidArgumentError(f"{fn}: layer {i}: experts stored need the types of {', '.join(EXPERT_MATRICES)}")
                stored[i] = (s, types, *layer.experts)
            if layer.streamed is not None:
                self.streamed[i] = ({name: buf for name, (_, buf) in w.items()}, entries, caches, build, w)
        self.experts = ExpertSlots(kernels, model.expert_store or model.store, stored, model.expert_policy,
                                   model.expert_prefetch, self.stats_)
        self.output_norm = kernels._vector(fn, {"output_norm": model.output_norm}, "output_norm", model.n_embd)
        self.output = kernels._matrix(fn, {"output": model.output}, "output", model.n_vocab, model.n_embd)
        self.out_cfg = ModelConfig(arch="decoder", n_layer=0, n_embd=model.n_embd, n_head=1, n_head_kv=1, head_dim=1,
                                   n_ff=1, n_vocab=model.n_vocab, n_ctx_train=1, rms_eps=model.rms_eps,
                                   rope_mode=ROPE_NORMAL, rope_dims=0, logit_scale=model.logit_scale,
                                   final_softcap=model.final_softcap)
        self.closed = False

    def step(self, seqs, positions, x, logits, *, stream=None) -> None:
        fn, model = "pebble_decoder_step", self.model
        if self.closed:
            raise ClosedError(f"{fn}: the decoder was freed or never made")
        n = len(seqs)
        if not 1 <= n <= model.n_seq:
            raise InvalidArgumentError(f"{fn}: {n} tokens; the decoder holds 1..{model.n_seq} sequences")
        if len(positions) != n:
            raise SizeMismatchError(f"decoder step: {n} sequences but {len(positions)} positions")
        xs = np.frombuffer(host_buffer(x, writable=True, what="decoder x"), np.float32)
        pl = model.n_embd_per_layer
        if xs.size != n * (model.n_embd + model.n_layer * pl):
            raise SizeMismatchError(f"decoder step: x holds {xs.nbytes} bytes; {n} float32 rows of {model.n_embd} "
                                    f"and their per-layer inputs need {4 * n * (model.n_embd + model.n_layer * pl)}")
        per_layer = xs[n * model.n_embd:].reshape(n, model.n_layer, pl)  # Gemma 4's, after the hidden states
        xs = xs[:n * model.n_embd].reshape(n, model.n_embd)
        seen = set()
        for b, (seq, pos) in enumerate(zip(seqs, positions)):
            if not 0 <= seq < model.n_seq or seq in seen:
                raise InvalidArgumentError(f"{fn}: token {b} is of sequence {seq}; each of 0..{model.n_seq - 1} at "
                                           "most once a step")
            seen.add(seq)
            for i, (_, _, _, (cos, _), layer) in enumerate(self.layers):
                if pos < 0 or pos >= len(cos) or (pos >= layer.kv_rows and not layer.shape.ring):
                    top = min(len(cos), len(cos) if layer.shape.ring else layer.kv_rows) - 1
                    raise SizeMismatchError(f"{fn}: sequence {seq} at position {pos} is outside layer {i}'s 0..{top}")
        store = model.store
        for i, (buffers, entries, caches, build, w) in self.streamed.items():  # into the "slots"
            rows = self.layers[i][4].kv_rows
            for name, tensor_id in entries.items():
                store.restore(i, tensor_id, buffers[name])
            cfg, _, _, rope, layer = self.layers[i]
            self.layers[i] = (cfg, build(w), caches, rope, layer)
            for seq, pos in zip(seqs, positions) if layer.shape.kv_layer < 0 else ():  # a reader has no entries
                held = min(pos, rows)
                for cache, tensor_id in zip(caches[seq], model.kv_ids[seq]):
                    if held:
                        store.read(i, tensor_id, 0, cache[:held])
        for i, (cfg, lw, caches, (cos, sin), _) in enumerate(self.layers):  # layer by layer, as the native step
            if self.experts.prefetching and i in self.experts:
                self.experts.prefetch(i, cfg, lw, xs, self.max_rows)
            for b, (seq, pos) in enumerate(zip(seqs, positions)):
                k, v = caches[seq]
                xs[b] = attention_block(cfg, xs[b:b + 1], lw, k, v, pos, (cos[pos:pos + 1], sin[pos:pos + 1]))[0]
            if cfg.n_expert:  # the step's tokens together, expert by expert (each restored once where stored)
                xs[:] = ffn_block(cfg, xs, lw, self.experts.for_layer(i) if i in self.experts else None,
                                  self.max_rows)
            else:
                for b in range(n):
                    xs[b] = ffn_block(cfg, xs[b:b + 1], lw)[0]
            for b in range(n):  # Gemma 4's per-layer embedding and output scale, where the layer has them
                xs[b] = layer_tail(cfg, xs[b:b + 1], lw, per_layer[b:b + 1, i] if pl else None)[0]
        for i, (_, _, caches, _, _) in self.streamed.items():  # each new row back into its entry
            layer = self.layers[i][4]
            for seq, pos in zip(seqs, positions) if layer.shape.kv_layer < 0 else ():
                row = pos % layer.kv_rows if layer.shape.ring else pos
                for cache, tensor_id in zip(caches[seq], model.kv_ids[seq]):
                    store.write(i, tensor_id, row * cache[0].nbytes, cache[row:row + 1])
        if logits is not None:
            out = np.frombuffer(host_buffer(logits, writable=True, what="decoder logits"), np.float32)
            if out.size != n * model.n_vocab:
                raise SizeMismatchError(f"decoder step: logits hold {out.nbytes} bytes; {n} float32 rows of "
                                        f"{model.n_vocab} need {4 * n * model.n_vocab}")
            outer = OuterWeights(token_embd=None, output_norm=self.output_norm, output=self.output)
            out.reshape(n, model.n_vocab)[:] = [output_logits(self.out_cfg, outer, row) for row in xs]
        self.stats_["steps"] += 1
        self.stats_["tokens"] += n
        self.stats_["layer_passes"] += len(self.layers)
        self.graphs.decide((tuple(int(s) for s in seqs), logits is not None))  # no graphs here: counted only
        self.stats_.update(graphs_captured=self.graphs.captured, graph_replays=self.graphs.replays,
                           graphs_dropped=self.graphs.dropped)

    def stats(self) -> dict:
        if self.closed:
            raise ClosedError("pebble_decoder_stats: the decoder was freed or never made")
        return dict(self.stats_)

    def close(self) -> None:
        self.closed = True


def _gpt_oss_weights(where: str, w: dict, s, vec) -> dict:
    """gpt-oss's sinks and biases, each optional, refused as native/cuda/decoder.cu refuses them: the sinks
    not F32, a router's or expert's bias outside a layer of experts, or the experts' three biases not together."""
    present = {name for name in ("ffn_gate_exps_b", "ffn_up_exps_b", "ffn_down_exps_b") if _given(w, name)}
    if (_given(w, "attn_sinks") and w["attn_sinks"][0] != 0) or len(present) not in (0, 3) or \
            (not s.n_expert and (present or _given(w, "ffn_gate_inp_b"))):
        raise InvalidArgumentError(f"{where}: attn_sinks must be 0 F32 where given; ffn_gate_inp_b and the experts' "
                                   "biases (ffn_gate_exps_b, ffn_up_exps_b, ffn_down_exps_b, all three or none) are for "
                                   "a layer of experts")
    E, fx, e = s.n_expert, s.n_ff_exp, s.n_embd
    return dict(attn_sinks=vec("attn_sinks", s.n_head, optional=True), bo=vec("bo", e, optional=True),
                ffn_gate_inp_b=vec("ffn_gate_inp_b", E, optional=True),
                ffn_gate_exps_b=vec("ffn_gate_exps_b", E * fx, optional=True),
                ffn_up_exps_b=vec("ffn_up_exps_b", E * fx, optional=True),
                ffn_down_exps_b=vec("ffn_down_exps_b", E * e, optional=True))


def _gemma4_weights(where: str, w: dict, s, n_pl: int, vec, mat) -> dict:
    """Gemma 4's per-layer embedding and output scale, refused as native/cuda/decoder.cu refuses them: a reader of
    another's caches giving K or V weights, V = K without V's norm, the per-layer weights not all three or without
    the model's width, or the parts of its layer of experts beside a dense FFN (the router's scale, the three norms
    and the experts' scales) missing there or given elsewhere."""
    if s.kv_layer >= 0 and any(_given(w, name) for name in ("wk", "wv", "bk", "bv", "k_norm")):
        raise InvalidArgumentError(f"{where}: the layer reads layer {s.kv_layer}'s caches (kv_layer), so it computes no "
                                   "K or V: wk, wv, bk, bv and k_norm must be NULL")
    if s.kv_layer < 0 and not _given(w, "wv") and (not s.v_norm or _given(w, "bv")):
        raise InvalidArgumentError(f"{where}: wv must not be NULL; V is K's projection (wv NULL) only where V is normed "
                                   "(v_norm 1) and has no bias")
    given = sum(_given(w, name) for name in ("per_layer_inp_gate", "per_layer_proj", "per_layer_post_norm"))
    if given not in (0, 3) or (given and n_pl < 1):
        raise InvalidArgumentError(f"{where}: per_layer_inp_gate, per_layer_proj and per_layer_post_norm go together "
                                   f"({given} of 3 given), with the model's n_embd_per_layer above 0 (it is {n_pl})")
    beside = bool(s.n_expert) and _given(w, "w_gate")  # the 26B-A4B's layer: a dense FFN beside the experts
    e = s.n_embd
    out = dict(out_scale=vec("out_scale", 1, optional=True))
    for name, optional in (("ffn_gate_inp_s", False), ("ffn_pre_norm_2", False), ("ffn_post_norm_1", False),
                           ("ffn_post_norm_2", False), ("ffn_down_exps_s", True)):
        if not beside and _given(w, name):
            raise InvalidArgumentError(f"{where}: {name} is given, but the layer has no dense FFN beside experts "
                                       f"(w_gate with n_expert above 0; it has n_expert {s.n_expert}), the only layer "
                                       "that reads it")
        if beside and not optional and not _given(w, name):
            raise InvalidArgumentError(f"{where}: {name} must not be NULL: a dense FFN beside experts (Gemma 4's) needs "
                                       "ffn_gate_inp_s, ffn_pre_norm_2, ffn_post_norm_1 and ffn_post_norm_2 "
                                       "(ffn_down_exps_s optional)")
        if beside:
            out[name] = vec(name, s.n_expert if name == "ffn_down_exps_s" else e, optional=optional)
    if given:
        out.update(per_layer_inp_gate=mat("per_layer_inp_gate", n_pl, e), per_layer_proj=mat("per_layer_proj", e, n_pl),
                   per_layer_post_norm=vec("per_layer_post_norm", e))
    return out


def _source_caches(fn: str, i: int, layer, layers, built: list) -> list:
    """The caches of the earlier layer a Gemma 4 layer reads (shape.kv_layer), checked as native/cuda/decoder.cu
    checks them: a layer with caches of its own, not streamed, of the same KV heads, head size, ring and rows."""
    src, s = layer.shape.kv_layer, layer.shape
    source = layers[src] if src < i else None
    if source is None or source.shape.kv_layer >= 0 or source.streamed is not None or \
            (source.shape.n_head_kv, source.shape.head_dim, source.shape.ring, source.kv_rows) != \
            (s.n_head_kv, s.head_dim, s.ring, layer.kv_rows):
        raise InvalidArgumentError(f"{fn}: layer {i} reads layer {src}'s caches (kv_layer): that must be an earlier "
                                   "layer with caches of its own, not streamed, of the same n_head_kv, head_dim, ring "
                                   "and kv_rows")
    return built[src][2]


def _given(weights: dict, name: str) -> bool:
    """Whether the layer names a buffer for `name` ((type, None): a type only, as a streamed layer's are)."""
    return (weights.get(name) or (None, None))[1] is not None


def _wanted(where: str, weights: dict, name: str, wanted) -> bool:
    """Whether the layer computes with `name` (the shape says); one given that it does not is refused, as
    native/cuda/decoder.cu refuses it."""
    if not wanted and _given(weights, name):
        raise InvalidArgumentError(f"{where}: {name} is given but the shape has no use for it")
    return bool(wanted)

"""The stub backend's kernels: the reference semantics of pebble_type_block, pebble_dequantize,
pebble_matvec, pebble_attend and the decode step (pebble_decoder_*), in numpy.

Elements are decoded by gguf-py's own dequantize (float32), products and sums are float32, and the
same arguments are accepted and refused as by native/pebble_quant.cu and pebble_decode.cu, with the
same messages. The decode step is the model's own forward pass (pyplugin.model.transformer) run on
these kernels, every matrix multiplied from its GGUF bytes as the native step does: there is no
second copy of the layer here.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ClosedError, InvalidArgumentError, SizeMismatchError
from ..ggml_types import DENSE_TYPES, SUPPORTED_TEXT, SUPPORTED_TYPES, block, type_name
from ..model.qweight import QuantWeight
from ..model.transformer import (ROPE_NEOX, ROPE_NORMAL, LayerWeights, ModelConfig, OuterWeights, layer_forward,
                                 output_logits)
from .abi import DECODER_MAX_BATCH, MATVEC_MAX_VEC
from .interface import as_int, check_attend_counts, host_buffer
from .kernels import Kernels

_DTYPE_OF = {ggml_type: dtype for dtype, ggml_type in DENSE_TYPES.items()}  # F32, F16 -> numpy dtype


class StubDecoder:
    """pebble_decoder_*'s semantics: the model's forward pass (transformer.layer_forward, then the output
    norm and projection) for each token of a step, over the weights and caches named once, with the same
    arguments accepted and refused as native/pebble_decode.cu."""

    def __init__(self, kernels: "StubKernels", model, layers, k_caches, v_caches):
        fn = "pebble_decoder_create"
        if min(model.n_layer, model.n_embd, model.n_vocab, model.n_seq) < 1 or model.n_seq > DECODER_MAX_BATCH:
            raise InvalidArgumentError(f"{fn}: n_layer {model.n_layer}, n_embd {model.n_embd} and n_vocab "
                                       f"{model.n_vocab} must each be at least 1, n_seq {model.n_seq} within "
                                       f"1..{DECODER_MAX_BATCH}")
        if len(layers) != model.n_layer or len(k_caches) != model.n_layer * model.n_seq or \
                len(v_caches) != len(k_caches):
            raise SizeMismatchError(f"decoder: {len(layers)} layers and {len(k_caches)} K / {len(v_caches)} V caches; "
                                    f"{model.n_layer} layers of {model.n_seq} sequences need "
                                    f"{model.n_layer * model.n_seq} of each")
        if model.kv_type not in _DTYPE_OF:
            raise InvalidArgumentError(f"{fn}: kv_type {model.kv_type}; the caches must be 0 F32 or 1 F16")
        self.model, self.layers, self.stats_ = model, [], {"steps": 0, "tokens": 0, "layer_passes": 0}
        for i, layer in enumerate(layers):
            where, s = f"{fn}: layer {i}", layer.shape
            kernels._check_shape(where, s, layer.kv_rows)
            e, q_rows, kv_rows = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
            w = layer.weights
            vec, mat = (lambda *a, **k: kernels._vector(where, w, *a, **k)), (lambda *a: kernels._matrix(where, w, *a))
            lw = LayerWeights(
                attn_norm=vec("attn_norm", e), wq=mat("wq", q_rows, e), wk=mat("wk", kv_rows, e),
                wv=mat("wv", kv_rows, e), wo=mat("wo", e, q_rows), ffn_norm=vec("ffn_norm", e),
                w_gate=mat("w_gate", s.n_ff, e), w_up=mat("w_up", s.n_ff, e), w_down=mat("w_down", e, s.n_ff),
                bq=vec("bq", q_rows, optional=True), bk=vec("bk", kv_rows, optional=True),
                bv=vec("bv", kv_rows, optional=True), q_norm=vec("q_norm", s.head_dim, optional=True),
                k_norm=vec("k_norm", s.head_dim, optional=True), post_attn_norm=vec("post_attn_norm", e, optional=True),
                post_ffn_norm=vec("post_ffn_norm", e, optional=True))
            if (lw.q_norm is not None or lw.k_norm is not None) and (lw.bq is not None or lw.bk is not None):
                raise InvalidArgumentError(f"{where}: Q/K norms together with Q/K biases are not supported")
            if s.n_embd != model.n_embd:
                raise SizeMismatchError(f"{fn}: layer {i} is {s.n_embd} wide; the model is {model.n_embd}")
            cos, sin = (np.frombuffer(host_buffer(t, writable=False, what="decoder rope"), np.float32)
                        .reshape(-1, 1, s.head_dim) for t in (layer.rope_cos, layer.rope_sin))
            caches = []
            for seq in range(model.n_seq):
                pair = []
                for name, arrays in (("k_cache", k_caches), ("v_cache", v_caches)):
                    c = np.frombuffer(host_buffer(arrays[i * model.n_seq + seq], writable=True, what="decoder cache"),
                                      _DTYPE_OF[model.kv_type])
                    want = layer.kv_rows * s.n_head_kv * s.head_dim
                    if c.size != want:
                        raise SizeMismatchError(f"decoder: layer {i}: a {name} holds {c.nbytes} bytes; "
                                                f"{want * c.itemsize} are needed")
                    pair.append(c.reshape(layer.kv_rows, s.n_head_kv, s.head_dim))
                caches.append(tuple(pair))
            cfg = ModelConfig(arch="decoder", n_layer=1, n_embd=e, n_head=s.n_head, n_head_kv=s.n_head_kv,
                              head_dim=s.head_dim, n_ff=s.n_ff, n_vocab=0, n_ctx_train=layer.kv_rows,
                              rms_eps=s.rms_eps, rope_mode=ROPE_NEOX if s.rope_neox else ROPE_NORMAL,
                              rope_dims=s.rope_dims, attn_scale=float(layer.attn_scale),
                              activation="gelu" if s.gelu else "silu", window=layer.kv_rows if s.ring else 0,
                              attn_softcap=float(s.attn_softcap), residual_scale=float(s.residual_scale))
            self.layers.append((cfg, lw, caches, (cos, sin), layer))
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
        if xs.size != n * model.n_embd:
            raise SizeMismatchError(f"decoder step: x holds {xs.nbytes} bytes; {n} float32 rows of {model.n_embd} "
                                    f"need {4 * n * model.n_embd}")
        xs = xs.reshape(n, model.n_embd)
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
        for b, (seq, pos) in enumerate(zip(seqs, positions)):
            h = xs[b:b + 1]
            for cfg, lw, caches, (cos, sin), _ in self.layers:
                k, v = caches[seq]
                h = layer_forward(cfg, h, lw, k, v, pos, (cos[pos:pos + 1], sin[pos:pos + 1]))
            xs[b] = h[0]
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

    def stats(self) -> dict:
        if self.closed:
            raise ClosedError("pebble_decoder_stats: the decoder was freed or never made")
        return dict(self.stats_)

    def close(self) -> None:
        self.closed = True


class StubKernels:
    """The quantized-tensor kernels in numpy: elements decoded by gguf-py's own dequantize (float32),
    products and sums in float32; the same arguments accepted and refused as native/pebble_quant.cu,
    with the same messages. Host buffers only; a call is done when it returns."""

    backend = "stub"
    MAX_VEC = MATVEC_MAX_VEC

    def _type(self, fn: str, ggml_type) -> tuple[int, str, int, int]:
        """(id, name, block elements, block bytes) of a type with kernels."""
        ggml_type = as_int(ggml_type, "ggml type")
        if ggml_type in SUPPORTED_TYPES:
            return (ggml_type, SUPPORTED_TYPES[ggml_type], *block(ggml_type))
        name = type_name(ggml_type)
        if name == "unknown":
            raise InvalidArgumentError(f"{fn}: {ggml_type} is not a GGUF type id; supported: {SUPPORTED_TEXT}")
        raise InvalidArgumentError(f"{fn}: GGUF type {ggml_type} ({name}) has no kernels; supported: "
                                   f"{SUPPORTED_TEXT}")

    def type_block(self, ggml_type) -> tuple[int, int]:
        _, _, elements, nbytes = self._type("pebble_type_block", ggml_type)
        return elements, nbytes

    @staticmethod
    def _decode(ggml_type: int, raw: np.ndarray, n_rows: int) -> np.ndarray:
        """[n_rows, n_cols] float32, as gguf decodes it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = raw.reshape(n_rows, -1)
        if ggml_type == 0:
            return rows.view(np.float32)
        return dequantize(rows, GGMLQuantizationType(ggml_type)).astype(np.float32, copy=False)

    def dequantize(self, ggml_type, src, n_elements, out, *, stream=None) -> None:
        ggml_type, name, elements, block_bytes = self._type("pebble_dequantize", ggml_type)
        n_elements = as_int(n_elements, "n_elements")
        if n_elements < 1:
            raise InvalidArgumentError(f"pebble_dequantize: {name}: n_elements must be at least 1, got {n_elements}")
        src = np.frombuffer(host_buffer(src, writable=False, what="dequantize src"), np.uint8)
        dst = host_buffer(out, writable=True, what="dequantize out")
        if n_elements % elements:
            raise SizeMismatchError(f"pebble_dequantize: {name}: n_elements {n_elements} is not a multiple of "
                                    f"the {elements}-element block")
        n_blocks = n_elements // elements
        want = n_blocks * block_bytes
        if src.nbytes != want:
            raise SizeMismatchError(f"pebble_dequantize: {name}: {n_elements} elements are {n_blocks} blocks of "
                                    f"{block_bytes} bytes = {want} bytes, but src_bytes is {src.nbytes}")
        if dst.nbytes != 2 * n_elements:
            raise SizeMismatchError(f"dequantize: out holds {dst.nbytes} bytes; {n_elements} fp16 elements "
                                    f"need {2 * n_elements}")
        halves = np.frombuffer(dst, np.float16)
        if ggml_type == 1:  # already fp16: every bit kept, NaN payloads included
            halves.view(np.uint8)[:] = src
            return
        with np.errstate(over="ignore"):  # beyond fp16's range: +-inf, as the kernels round
            halves[:] = self._decode(ggml_type, src, 1).reshape(-1)

    def matvec(self, ggml_type, w, n_rows, n_cols, x, n_vec, out, *, stream=None) -> None:
        self._matvec("matvec", ggml_type, w, n_rows, n_cols, x, n_vec, out)

    def matmul(self, ggml_type, w, n_rows, n_cols, x, n_vec, out, *, stream=None) -> None:
        """pebble_matmul: matvec for any number of vectors."""
        self._matvec("matmul", ggml_type, w, n_rows, n_cols, x, n_vec, out)

    def matmul_f32(self, ggml_type, w, n_rows, n_cols, x, n_vec, out, *, stream=None) -> None:
        """pebble_matmul_f32: matmul of float32 vectors, each element rounded to fp16 first."""
        self._matvec("matmul_f32", ggml_type, w, n_rows, n_cols, x, n_vec, out)

    def _matvec(self, fn, ggml_type, w, n_rows, n_cols, x, n_vec, out) -> None:
        ggml_type, name, elements, block_bytes = self._type(f"pebble_{fn}", ggml_type)
        n_rows, n_cols, n_vec = as_int(n_rows, "n_rows"), as_int(n_cols, "n_cols"), as_int(n_vec, "n_vec")
        if fn == "matvec" and not 1 <= n_vec <= MATVEC_MAX_VEC:
            raise InvalidArgumentError(f"pebble_matvec: {name}: n_vec {n_vec} is outside 1..{MATVEC_MAX_VEC}")
        if n_vec < 1:
            raise InvalidArgumentError(f"pebble_{fn}: {name}: n_vec must be at least 1, got {n_vec}")
        if n_rows < 1 or n_cols < 1:
            raise InvalidArgumentError(f"pebble_{fn}: {name}: n_rows and n_cols must be at least 1, got "
                                       f"{n_rows} x {n_cols}")
        w = np.frombuffer(host_buffer(w, writable=False, what=f"{fn} w"), np.uint8)
        x = np.frombuffer(host_buffer(x, writable=False, what=f"{fn} x"), np.float32 if fn == "matmul_f32" else np.float16)
        y = host_buffer(out, writable=True, what=f"{fn} out")
        if n_cols % elements:
            raise SizeMismatchError(f"pebble_{fn}: {name}: n_cols {n_cols} is not a multiple of the "
                                    f"{elements}-element block")
        row_bytes = n_cols // elements * block_bytes
        if w.nbytes != n_rows * row_bytes:
            raise SizeMismatchError(f"pebble_{fn}: {name}: {n_rows} rows of {n_cols} elements are {n_rows} x "
                                    f"{row_bytes} = {n_rows * row_bytes} bytes, but w_bytes is {w.nbytes}")
        if x.size != n_vec * n_cols:
            raise SizeMismatchError(f"{fn}: x holds {x.nbytes} bytes; {n_vec} {x.dtype.name} vectors of {n_cols} "
                                    f"need {x.itemsize * n_vec * n_cols}")
        if x.dtype == np.float32:
            with np.errstate(over="ignore"):  # beyond fp16's range: +-inf, as the library rounds
                x = x.astype(np.float16)
        if y.nbytes != 4 * n_vec * n_rows:
            raise SizeMismatchError(f"{fn}: out holds {y.nbytes} bytes; {n_vec} float32 vectors of "
                                    f"{n_rows} need {4 * n_vec * n_rows}")
        weights = self._decode(ggml_type, w, n_rows)
        # One vector at a time, as the native kernels sum each vector alone: a BLAS GEMM over several would
        # round each differently from its own product, and a batch's rows must not depend on each other.
        xs, ys = x.reshape(n_vec, n_cols).astype(np.float32), np.frombuffer(y, np.float32).reshape(n_vec, n_rows)
        with np.errstate(invalid="ignore", over="ignore"):  # inf in x gives inf or NaN, as the library does
            for v in range(n_vec):
                np.matmul(xs[v:v + 1], weights.T, out=ys[v:v + 1])

    # -- the decode step: pebble_decoder_*'s semantics, as the model's forward pass over these kernels

    def decoder(self, model, layers, k_caches, v_caches) -> "StubDecoder":
        return StubDecoder(self, model, layers, k_caches, v_caches)

    @staticmethod
    def _check_shape(where: str, s, n_rows: int) -> None:
        if min(s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff, n_rows) < 1:
            raise InvalidArgumentError(f"{where}: n_embd {s.n_embd}, n_head {s.n_head}, n_head_kv {s.n_head_kv}, "
                                       f"head_dim {s.head_dim}, n_ff {s.n_ff} and n_ctx {n_rows} must each be at least 1")
        if s.n_head % s.n_head_kv:
            raise InvalidArgumentError(f"{where}: {s.n_head} query heads cannot share {s.n_head_kv} KV heads evenly")
        if not 0 <= s.rope_dims <= s.head_dim or s.rope_dims % 2:
            raise InvalidArgumentError(f"{where}: rope_dims {s.rope_dims} must be even and within 0..head_dim "
                                       f"({s.head_dim})")
        if s.gelu not in (0, 1):
            raise InvalidArgumentError(f"{where}: gelu is {s.gelu}; 0 (SwiGLU) or 1 (GELU) are accepted")
        if s.ring not in (0, 1):
            raise InvalidArgumentError(f"{where}: ring is {s.ring}; 0 or 1 are accepted")
        if not (math.isfinite(s.attn_softcap) and s.attn_softcap >= 0 and math.isfinite(s.residual_scale)):
            raise InvalidArgumentError(f"{where}: attn_softcap {s.attn_softcap:g} must be finite and at least 0, "
                                       f"residual_scale {s.residual_scale:g} finite")

    def _vector(self, where: str, weights: dict, name: str, n: int, optional: bool = False):
        ref = weights.get(name)
        if ref is None:
            if optional:
                return None
            raise InvalidArgumentError(f"{where}: {name} must not be NULL")
        ggml_type, data = ref
        if ggml_type not in _DTYPE_OF:
            raise InvalidArgumentError(f"{where}: {name} has GGUF type {ggml_type}; vectors must be 0 F32 or 1 F16")
        values = np.frombuffer(host_buffer(data, writable=False, what=f"decoder {name}"), _DTYPE_OF[ggml_type])
        if values.size != n:
            raise SizeMismatchError(f"decoder: {where}: {name} holds {values.nbytes} bytes; GGUF type {ggml_type} "
                                    f"needs {n * values.itemsize} for this shape")
        return values.astype(np.float32)

    def _matrix(self, where: str, weights: dict, name: str, rows: int, cols: int) -> QuantWeight:
        ref = weights.get(name)
        if ref is None:
            raise InvalidArgumentError(f"{where}: {name} must not be NULL")
        ggml_type, data = ref
        _, name_of_type, elements, block_bytes = self._type(where, ggml_type)
        if cols % elements:
            raise SizeMismatchError(f"{where}: weight: {name}: {name_of_type} {rows} x {cols}: rows of whole "
                                    f"{elements}-element blocks are needed")
        raw = np.frombuffer(host_buffer(data, writable=False, what=f"decoder {name}"), np.uint8)
        if raw.nbytes != rows * (cols // elements) * block_bytes:
            raise SizeMismatchError(f"decoder: {where}: {name} holds {raw.nbytes} bytes; GGUF type {ggml_type} needs "
                                    f"{rows * (cols // elements) * block_bytes} for this shape")
        # Every matrix, dense ones too, through these kernels: the vector entering it is rounded to fp16, as
        # the native step hands fp16 vectors to its matrix kernels.
        return QuantWeight(ggml_type, (rows, cols), raw.reshape(rows, -1), self.kernels)

    # -- attention of a batch of sequences (pebble_attend's semantics, each sequence on its own)

    def attend_scratch_bytes(self, n_seq: int, n_head: int, n_rows: int) -> int:
        if min(n_seq, n_head, n_rows) < 1:
            raise InvalidArgumentError(f"pebble_attend_scratch_bytes: n_seq {n_seq}, n_head {n_head} and n_rows "
                                       f"{n_rows} must each be at least 1")
        return 0  # numpy allocates its own temporaries

    def attend(self, q, kv_type: int, k_caches, v_caches, n_pos, n_rows: int, n_head: int, n_head_kv: int,
               head_dim: int, scale: float, softcap: float, out, scratch, *, k_new=None, v_new=None,
               stream=None) -> None:
        check_attend_counts(k_caches, v_caches, n_pos)
        if min(len(k_caches), n_head, n_head_kv, head_dim, n_rows) < 1 or n_head % n_head_kv:
            raise InvalidArgumentError(f"pebble_attend: n_seq {len(k_caches)}, n_head {n_head}, n_head_kv {n_head_kv}, "
                                       f"head_dim {head_dim}, n_rows {n_rows}: each at least 1, the heads dividing")
        if (k_new is None) != (v_new is None):
            raise InvalidArgumentError("pebble_attend: k_new and v_new go together (both rows, or both NULL)")
        for b, n in enumerate(n_pos):
            if not 1 <= n <= n_rows:
                raise SizeMismatchError(f"pebble_attend: sequence {b} attends over {n} rows; 1..{n_rows} are in "
                                        "its cache")
        for what, rows in (("k_new", k_new), ("v_new", v_new)):
            if rows is not None and np.asarray(rows).size != len(k_caches) * n_head_kv * head_dim:
                raise SizeMismatchError(f"pebble_attend: {what} holds {np.asarray(rows).size} values; "
                                        f"{len(k_caches)} rows of {n_head_kv} heads of {head_dim} are needed")
        if k_new is not None:  # each new row into its cache, rounded to the cache's type as the library does
            for b, (k, v, n) in enumerate(zip(k_caches, v_caches, n_pos)):
                k[n - 1] = k_new[b].reshape(n_head_kv, head_dim)
                v[n - 1] = v_new[b].reshape(n_head_kv, head_dim)
        group = n_head // n_head_kv
        for b, (k, v, n) in enumerate(zip(k_caches, v_caches, n_pos)):
            qh = (q[b].reshape(n_head_kv, group, head_dim) * np.float32(scale)).astype(np.float32)
            keys = k[:n].astype(np.float32).transpose(1, 2, 0)                   # [n_kv, hd, n]
            scores = qh @ keys                                                    # [n_kv, group, n]
            if softcap > 0:
                scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            out[b] = (scores @ v[:n].astype(np.float32).transpose(1, 0, 2)).reshape(-1)

    @property
    def kernels(self):
        """These kernels behind the interface the model's QuantWeight computes with."""
        kernels = self.__dict__.get("_kernels")
        if kernels is None:
            kernels = self.__dict__["_kernels"] = Kernels(self, np)
        return kernels

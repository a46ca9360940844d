"""The stub backend's kernels: the reference semantics of pebble_type_block, pebble_dequantize(_rows),
pebble_matvec, pebble_attend, in numpy; the decode step (pebble_decoder_*) is stub_decoder's.

Elements are decoded by gguf-py's own dequantize (float32), products and sums are float32, and the
same arguments are accepted and refused as by native/cuda/'s launchers and the decode step, with the
same messages. The decode step is the model's own forward pass (pyplugin.model.transformer) run on
these kernels, every matrix multiplied from its GGUF bytes as the native step does: there is no
second copy of the layer here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from ..errors import InvalidArgumentError, SizeMismatchError
from ..ggml_types import SUPPORTED_TEXT, SUPPORTED_TYPES, block, type_name
from ..kv_types import KV_BY_GGML, decode, encode
from ..model.qweight import QuantWeight
from .abi import MATVEC_MAX_VEC
from .interface import as_int, check_attend_counts, host_buffer
from .kernels import Kernels
from .stub_decoder import _DTYPE_OF, StubDecoder



class StubKernels:
    """The quantized-tensor kernels in numpy: elements decoded by gguf-py's own dequantize (float32),
    products and sums in float32; the same arguments accepted and refused as native/cuda/matvec.cu,
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

    def dequantize_rows(self, ggml_type, table, n_cols, rows) -> np.ndarray:
        """pebble_dequantize_rows: rows `rows` of the matrix whose GGUF bytes are `table`, float32."""
        ggml_type, name, elements, block_bytes = self._type("pebble_dequantize_rows", ggml_type)
        n_cols, ids = as_int(n_cols, "n_cols"), np.asarray(rows, dtype=np.int64).reshape(-1)
        if n_cols < 1:
            raise InvalidArgumentError(f"pebble_dequantize_rows: {name}: n_cols must be at least 1 and n_rows at "
                                       f"least 0, got {n_cols} and {ids.size}")
        if ids.size == 0:
            return np.empty((0, n_cols), dtype=np.float32)
        src = np.frombuffer(host_buffer(table, writable=False, what="dequantize_rows table"), np.uint8)
        if n_cols % elements:
            raise SizeMismatchError(f"pebble_dequantize_rows: {name}: n_cols {n_cols} is not a multiple of the "
                                    f"{elements}-element block")
        row_bytes = n_cols // elements * block_bytes
        if src.nbytes % row_bytes:
            raise SizeMismatchError(f"pebble_dequantize_rows: {name}: table_bytes {src.nbytes} is not a whole number "
                                    f"of {row_bytes}-byte rows of {n_cols} elements")
        table_rows = src.nbytes // row_bytes
        bad = np.flatnonzero((ids < 0) | (ids >= table_rows))
        if bad.size:
            held = (f"has rows 0..{table_rows - 1}" if table_rows else
                    "is empty (table_bytes 0): it has no rows to take")
            raise InvalidArgumentError(f"pebble_dequantize_rows: {name}: rows[{bad[0]}] is {ids[bad[0]]}; "
                                       f"the table {held}")
        raw = src.reshape(table_rows, row_bytes)[ids]
        return np.array(self._decode(ggml_type, raw, ids.size).reshape(ids.size, n_cols), dtype=np.float32)

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

    def decoder(self, model, layers, k_caches, v_caches):
        """A StubDecoder (stub_decoder.py) over these kernels."""
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
        if s.activation not in (0, 1, 2) or (s.activation == 2 and s.n_expert < 1):
            raise InvalidArgumentError(f"{where}: activation is {s.activation}; 0 (SwiGLU), 1 (GELU) or, in a layer of "
                                       "experts, 2 (gpt-oss's clamped SwiGLU) are accepted")
        if s.ring not in (0, 1):
            raise InvalidArgumentError(f"{where}: ring is {s.ring}; 0 or 1 are accepted")
        if s.v_norm not in (0, 1) or s.kv_layer < -1:
            raise InvalidArgumentError(f"{where}: v_norm is {s.v_norm} and kv_layer {s.kv_layer}; v_norm 0 or 1, kv_layer "
                                       "-1 (caches of its own) or an earlier layer's index are accepted")
        if not (math.isfinite(s.attn_softcap) and s.attn_softcap >= 0 and math.isfinite(s.residual_scale)):
            raise InvalidArgumentError(f"{where}: attn_softcap {s.attn_softcap:g} must be finite and at least 0, "
                                       f"residual_scale {s.residual_scale:g} finite")
        if not 0 <= s.n_expert <= 1 << 12 or s.n_ff_shexp < 0 or (s.n_expert and (
                not 1 <= s.n_expert_used <= min(s.n_expert, 16) or s.n_ff_exp < 1 or s.expert_norm not in (0, 1)
                or not math.isfinite(s.expert_scale) or s.expert_gating not in (0, 1)
                or (s.expert_gating == 1 and s.expert_norm))) or (not s.n_expert and s.expert_gating):
            raise InvalidArgumentError(f"{where}: experts: n_expert {s.n_expert} must be within 0..4096 and, above 0, "
                                       f"n_expert_used {s.n_expert_used} within 1..n_expert (and 16), n_ff_exp "
                                       f"{s.n_ff_exp} at least 1, expert_norm {s.expert_norm} 0 or 1, expert_scale "
                                       f"{s.expert_scale:g} finite, activation {s.activation} 0, 1 or 2, expert_gating "
                                       f"{s.expert_gating} 0 or 1 (1 with expert_norm 0; 0 without experts); n_ff_shexp "
                                       f"{s.n_ff_shexp} at least 0")

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
        kv = KV_BY_GGML.get(kv_type)
        if kv is None or head_dim % kv.block:
            raise InvalidArgumentError(f"pebble_attend: kv_type {kv_type} with head_dim {head_dim}; the caches must be "
                                       "0 F32, 1 F16, or 8 Q8_0 or 2 Q4_0 where head_dim is a multiple of 32")
        if k_new is not None:  # each new row into its cache, encoded in the cache's type as the library does
            for b, (k, v, n) in enumerate(zip(k_caches, v_caches, n_pos)):
                k[n - 1] = encode(np.asarray(k_new[b], np.float32).reshape(n_head_kv, head_dim), kv)
                v[n - 1] = encode(np.asarray(v_new[b], np.float32).reshape(n_head_kv, head_dim), kv)
        group = n_head // n_head_kv
        for b, (k, v, n) in enumerate(zip(k_caches, v_caches, n_pos)):
            qh = (q[b].reshape(n_head_kv, group, head_dim) * np.float32(scale)).astype(np.float32)
            keys = decode(k[:n], kv).transpose(1, 2, 0)                           # [n_kv, hd, n]
            scores = qh @ keys                                                    # [n_kv, group, n]
            if softcap > 0:
                scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            out[b] = (scores @ decode(v[:n], kv).transpose(1, 0, 2)).reshape(-1)

    def attend_prompt(self, q, kv_type: int, k_cache, v_cache, pos: int, n_rows: int, n_head: int, n_head_kv: int,
                      head_dim: int, window: int, scale: float, softcap: float, out, *, stream=None,
                      sinks=None) -> None:
        """pebble_attend_prompt's semantics: the model's own attention (pyplugin.model.attention) over the
        caches' rows read back from their type."""
        q = np.asarray(q, np.float32)
        if min(n_head, n_head_kv, head_dim) < 1 or pos < 0 or window < 0 or q.size == 0:
            raise InvalidArgumentError(f"pebble_attend_prompt: n_tok {q.size // max(1, n_head * head_dim)}, n_head "
                                       f"{n_head}, n_head_kv {n_head_kv} and head_dim {head_dim} must each be at least "
                                       f"1, pos {pos} and window {window} at least 0")
        if n_head % n_head_kv:
            raise InvalidArgumentError(f"pebble_attend_prompt: {n_head} query heads cannot share {n_head_kv} KV heads "
                                       "evenly")
        kv = KV_BY_GGML.get(kv_type)
        if kv is None or head_dim % kv.block:
            raise InvalidArgumentError(f"pebble_attend_prompt: kv_type {kv_type} with head_dim {head_dim}; the caches "
                                       "must be 0 F32, 1 F16, or 8 Q8_0 or 2 Q4_0 where head_dim is a multiple of 32")
        if not (softcap >= 0 and math.isfinite(softcap) and math.isfinite(scale)):
            raise InvalidArgumentError(f"pebble_attend_prompt: scale {scale:g} and softcap {softcap:g} must be finite, "
                                       "softcap at least 0")
        n_tok = q.size // (n_head * head_dim)
        if pos + n_tok > n_rows:
            raise SizeMismatchError(f"pebble_attend_prompt: queries at positions {pos}..{pos + n_tok - 1} need that "
                                    f"many cache rows; the caches hold {n_rows}")
        from ..model.attention import attention  # noqa: PLC0415 - the model's modules import the store's

        cfg = SimpleNamespace(n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_group=n_head // n_head_kv,
                              query_scale=np.float32(scale), attn_softcap=softcap, window=window)
        k, v = (decode(c[:pos + n_tok], kv) for c in (k_cache, v_cache))
        if sinks is not None and np.asarray(sinks).shape != (n_head,):
            raise SizeMismatchError(f"attend_prompt: sinks hold {np.asarray(sinks).size} values; {n_head} are needed")
        out[...] = attention(cfg, q.reshape(n_tok, n_head, head_dim), k, v, pos, 0, sinks).reshape(out.shape)

    @property
    def kernels(self):
        """These kernels behind the interface the model's QuantWeight computes with."""
        kernels = self.__dict__.get("_kernels")
        if kernels is None:
            kernels = self.__dict__["_kernels"] = Kernels(self, np)
        return kernels

"""Synthetic GGUF models: random weights in the layouts llama.cpp's converter writes, a real
tokenizer learned from a small built-in text, and a chat template.

Tests build their tiny models with it and the demo model (pyplugin.serving.registry) is one. Every file it
writes says "random weights" in general.name and carries ``pebbling.random_weights = true``.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, RopeScalingType

from ..ggml_types import SUPPORTED_NAMES
from .load import RANDOM_WEIGHTS_KEY, SUPPORTED_ARCHS
from . import synth_gemma4
from .synth_quant import quantize, random_blocks
from .synth_vocab import (CHATML_TEMPLATE, CORPUS, LLAMA3_TEMPLATE, PHI3_TEMPLATE, Vocab,  # noqa: F401
                          build_vocab)  # (the templates and CORPUS: for the tests)
from .tokenizer import UNUSED

T = GGMLQuantizationType


@dataclass(frozen=True)
class SynthSpec:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 512
    vocab: str = "llama3"               # "llama3", "chatml", "coder", "qwen3" (byte-level BPE), "spm", "gemma"
    pre: str | None = None              # BPE pre-tokenizer name; by default the flavour's own
    n_merges: int = 300
    vocab_size: int = 0                 # pad the vocabulary with unused tokens to this many (Gemma's 262144,
                                        # Qwen2's 151936): a real-sized embedding and output matrix
    weight_type: str = "F32"            # every matrix, unless tensor_types says otherwise
    tensor_types: dict[str, str] = field(default_factory=dict)  # role ("ffn_down", "token_embd"...) or a
                                                                # tensor ("blk.3.ffn_down") -> type
    tied_output: bool = False           # no output.weight: the output reuses token_embd
    rope_theta: float = 10000.0
    rope_dims: int | None = None        # default: the whole head
    rope_linear_factor: float | None = None
    rope_yarn: tuple[float, int] | None = None  # YaRN's (factor, original context length)
    rope_freqs: bool = False            # a llama3-style rope_freqs tensor
    rms_eps: float = 1e-5
    key_length: int | None = None       # the head size, when not n_embd / n_head (qwen3, Gemma, Mistral-Nemo)
    sliding_window: int = 0             # {arch}.attention.sliding_window, when above 0
    swa_pattern: int | list[bool] | None = None  # {arch}.attention.sliding_window_pattern, when given
    rope_theta_swa: float | None = None  # {arch}.rope.freq_base_swa, when given
    attn_softcap: float | None = None   # gemma2's attn_logit_softcapping, when given
    final_softcap: float | None = None  # final_logit_softcapping, when given
    chat_template: str | None = None    # None: the vocab flavour's template; "": none at all
    n_expert: int = 0                   # experts per layer (qwen2moe, qwen3moe; a llama file: Mixtral's layout)
    n_expert_used: int = 2
    n_ff_exp: int | None = None         # an expert's hidden size (qwen*moe; default n_ff // n_expert_used)
    n_ff_shexp: int | None = None       # qwen2moe's shared expert's (default n_ff)
    expert_weights_norm: bool | None = None  # {arch}.expert_weights_norm, when given
    gemma4: dict[str, Any] = field(default_factory=dict)  # a gemma4 file's variant (synth_gemma4.options)
    name: str | None = None
    description: str = "synthetic model with random weights, written by pyplugin.model.synth"
    seed: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)  # keys written last, over the ones above
    random_blocks: bool = False         # matrices written as random valid blocks of their types, streamed
                                        # (synth_quant.random_blocks): a model of billions of weights in seconds
    holes: bool = False                 # with random_blocks: every tensor's data left a hole of a sparse file
                                        # (zeros, valid blocks of the types written here): a real model's size
                                        # and layout on no disk, for estimates of models larger than the machine

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head


def write_gguf(path: str | os.PathLike, spec: SynthSpec | None = None, **overrides) -> Path:
    """Write a random-weight GGUF for ``spec`` (fields may be given as keywords) to ``path``."""
    spec = replace(spec or SynthSpec(), **overrides)
    if spec.arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch {spec.arch!r}: choose one of {', '.join(SUPPORTED_ARCHS)}")
    for name in {spec.weight_type, *spec.tensor_types.values()}:
        if name not in T.__members__:  # any GGUF type: tests write unsupported ones to see them refused
            raise ValueError(f"tensor type {name!r}: choose one of {', '.join(SUPPORTED_NAMES)}")
    vocab = build_vocab(spec.vocab, spec.n_merges, spec.pre, spec.vocab_size)  # a Gemma one pads itself
    if spec.vocab_size > len(vocab.tokens):
        pad = range(len(vocab.tokens), spec.vocab_size)
        vocab = replace(vocab, tokens=vocab.tokens + [f"[PAD{i}]" for i in pad], types=vocab.types + [UNUSED] * len(pad),
                        scores=None if vocab.scores is None else vocab.scores + [0.0] * len(pad))
    path = Path(path)
    writer = GGUFWriter(path, spec.arch)
    _add_hparams(writer, spec, len(vocab.tokens))
    _add_vocab(writer, vocab, spec)
    for key, value in spec.metadata.items():  # e.g. a crafted value, to see it refused
        writer.kv_data[0].pop(key, None)
        writer.add_key_value(key, value, _VALUE_TYPES[type(value)])  # np.uint32 for UINT32 keys
    if spec.random_blocks:
        _write_blocks(writer, spec, len(vocab.tokens))
        return path
    for name, array, qtype in _tensors(spec, len(vocab.tokens)):
        try:
            data = quantize(array.reshape(-1, array.shape[-1]), qtype)
            data = data.reshape(*array.shape[:-1], data.shape[-1])
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        except NotImplementedError:  # a type nothing here writes (IQ2_XXS, IQ1_S...): tests write it to see
            data = _unwritten_type_bytes(spec, name, array.shape, qtype)  # it refused; random bytes will do
        writer.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _unwritten_type_bytes(spec: SynthSpec, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    """Random bytes the size of the tensor's blocks of `qtype`, for a type neither gguf-py nor synth_quant
    writes: never decoded, since pebbling refuses the type."""
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{name}: {qtype.name} needs rows that are a multiple of {block} values; "
                         f"this tensor's rows have {shape[-1]}")
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    return rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)


def _write_blocks(writer: GGUFWriter, spec: SynthSpec, n_vocab: int) -> None:
    """The tensors as random blocks, each made as it is written (never the whole model in memory)."""
    tensors = list(_tensors(spec, n_vocab, lazy=True))
    for name, array, qtype in tensors:
        if isinstance(array, np.ndarray):
            writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
            continue
        shape, _ = array
        block, size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise ValueError(f"{name}: {qtype.name} needs rows that are a multiple of {block} values; this tensor's "
                             f"rows have {shape[-1]}")
        nbytes = int(np.prod(shape[:-1])) * (shape[-1] // block) * size
        writer.add_tensor_info(name, (*shape[:-1], nbytes // int(np.prod(shape[:-1]))), np.dtype(np.uint8),
                               nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if spec.holes:  # the data section's size, as write_tensor_data pads it, and nothing written into it
        fout, align = writer.fout[0], writer.data_alignment
        end = -(-fout.tell() // align) * align + sum(-(-ti.nbytes // align) * align for ti in writer.tensors[0].values())
        fout.truncate(end)
        writer.close()
        return
    for name, array, qtype in tensors:
        if not isinstance(array, np.ndarray):
            shape, scale = array
            rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
            array = random_blocks(qtype, int(np.prod(shape[:-1])), shape[-1], rng, scale)
        writer.write_tensor_data(array)
    writer.close()


# ---------------------------------------------------------------------------------------------------
# metadata


_VALUE_TYPES = {bool: GGUFValueType.BOOL, int: GGUFValueType.INT64, float: GGUFValueType.FLOAT32,
                str: GGUFValueType.STRING, np.uint32: GGUFValueType.UINT32, list: GGUFValueType.ARRAY}


def _add_hparams(w: GGUFWriter, spec: SynthSpec, n_vocab: int) -> None:
    w.add_name(spec.name or f"pebbling synthetic {spec.arch} (random weights)")
    w.add_description(spec.description)
    w.add_bool(RANDOM_WEIGHTS_KEY, True)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.rope_dims or spec.head_dim)
    if spec.rope_linear_factor:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_linear_factor)
    if spec.rope_yarn:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.rope_yarn[0])
        w.add_rope_scaling_orig_ctx_len(spec.rope_yarn[1])
    if spec.key_length or spec.arch in _OWN_HEAD_SIZE:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    arch = spec.arch
    if spec.sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
    if isinstance(spec.swa_pattern, list):
        w.add_array(f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)
    elif spec.swa_pattern is not None:
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)
    if spec.rope_theta_swa is not None:
        w.add_float32(f"{arch}.rope.freq_base_swa", spec.rope_theta_swa)
    for key, cap in (("attn_logit_softcapping", spec.attn_softcap), ("final_logit_softcapping", spec.final_softcap)):
        if cap is not None:
            w.add_float32(f"{arch}.{key}", cap)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        if arch != "llama":
            w.add_expert_feed_forward_length(_ff_exp(spec))
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(spec.n_ff_shexp or spec.n_ff)
        if spec.expert_weights_norm is not None:
            w.add_bool(f"{arch}.expert_weights_norm", spec.expert_weights_norm)
    if arch == "gemma4":
        synth_gemma4.add_hparams(w, spec)
    w.add_vocab_size(n_vocab)


def _ff_exp(spec: SynthSpec) -> int:
    if spec.arch == "llama":
        return spec.n_ff
    return spec.n_ff_exp or max(1, spec.n_ff // spec.n_expert_used)


def _add_vocab(w: GGUFWriter, vocab: Vocab, spec: SynthSpec) -> None:
    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    for add, token_id in ((w.add_bos_token_id, vocab.bos_id), (w.add_eos_token_id, vocab.eos_id),
                          (w.add_eot_token_id, vocab.eot_id), (w.add_unk_token_id, vocab.unk_id)):
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.add_space_prefix is not None:
        w.add_add_space_prefix(vocab.add_space_prefix)
    template = vocab.chat_template if spec.chat_template is None else spec.chat_template
    if template:
        w.add_chat_template(template)


# ---------------------------------------------------------------------------------------------------
# tensors


def _tensors(spec: SynthSpec, n_vocab: int, lazy: bool = False) -> Iterable[tuple[str, Any, GGMLQuantizationType]]:
    """(name, float32 array in numpy order [out, in], type) for every tensor, as the converter names
    and lays them out; `lazy`: a matrix of a block type as (shape, scale) instead, made when written."""
    e, ff, hd = spec.n_embd, spec.n_ff, spec.head_dim
    q_rows, kv_rows = spec.n_head * hd, spec.n_head_kv * hd

    def matrix(role: str, name: str, rows: int, cols: int, scale: float | None = None, stack: tuple = (),
               default: str | None = None):
        # a tensor's own name ("blk.3.ffn_down") over its role's type, over the file's; `stack`: leading
        # dims (merged experts [n_expert, rows, cols])
        kind = spec.tensor_types.get(role, default or spec.weight_type)
        qtype = T[spec.tensor_types.get(name.removesuffix(".weight"), kind)]
        if lazy and qtype not in (T.F32, T.F16):
            return name, ((*stack, rows, cols), scale or cols ** -0.5), qtype
        return name, _random(spec.seed, name, (*stack, rows, cols), scale or cols ** -0.5), qtype

    def vector(name: str, n: int, mean: float, scale: float):
        return name, mean + _random(spec.seed, name, (n,), scale), T.F32

    if spec.arch == "gemma4":
        yield from synth_gemma4.tensors(spec, n_vocab, matrix, vector, _random)
        return
    gemma = spec.arch in ("gemma2", "gemma3")
    # A Gemma's embedding is scaled up by sqrt(n_embd) in the forward pass: rows of unit RMS there.
    yield matrix("token_embd", "token_embd.weight", n_vocab, e, e ** -0.5 if gemma else 1.0)
    yield vector("output_norm.weight", e, 1.0, 0.1)
    if not (spec.tied_output or gemma):  # the Gemmas always tie it
        yield matrix("output", "output.weight", n_vocab, e)
    if spec.rope_freqs:
        n = (spec.rope_dims or hd) // 2
        yield "rope_freqs.weight", np.linspace(1.0, 8.0, n, dtype=np.float32), T.F32
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        yield vector(f"{b}.attn_norm.weight", e, 1.0, 0.1)
        # gpt-oss's norm before its experts has the name a Gemma's norm after attention has
        yield vector(f"{b}.{'post_attention_norm' if spec.arch == 'gpt-oss' else 'ffn_norm'}.weight", e, 1.0, 0.1)
        if spec.arch == "phi3":
            yield matrix("attn_qkv", f"{b}.attn_qkv.weight", q_rows + 2 * kv_rows, e)
            yield matrix("ffn_up", f"{b}.ffn_up.weight", 2 * ff, e)    # gate rows, then up rows
        else:
            name, wq, qt = matrix("attn_q", f"{b}.attn_q.weight", q_rows, e)
            name_k, wk, kt = matrix("attn_k", f"{b}.attn_k.weight", kv_rows, e)
            if spec.arch == "llama" and isinstance(wq, np.ndarray):  # the converter's row order, for GGML's normal RoPE mode
                wq, wk = permute_qk(wq, spec.n_head), permute_qk(wk, spec.n_head_kv)
            yield name, wq, qt
            yield name_k, wk, kt
            yield matrix("attn_v", f"{b}.attn_v.weight", kv_rows, e)
            if spec.n_expert:
                yield from _expert_tensors(spec, b, matrix, vector)
            else:
                yield matrix("ffn_gate", f"{b}.ffn_gate.weight", ff, e)
                yield matrix("ffn_up", f"{b}.ffn_up.weight", ff, e)
            if spec.arch in ("qwen2", "qwen2moe", "gpt-oss"):
                for t, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                    yield vector(f"{b}.{t}.bias", rows, 0.0, 0.1)
            if spec.arch in ("qwen3", "gemma3", "qwen3moe"):
                yield vector(f"{b}.attn_q_norm.weight", hd, 1.0, 0.1)
                yield vector(f"{b}.attn_k_norm.weight", hd, 1.0, 0.1)
            if gemma:
                yield vector(f"{b}.post_attention_norm.weight", e, 1.0, 0.1)
                yield vector(f"{b}.post_ffw_norm.weight", e, 1.0, 0.1)
        yield matrix("attn_output", f"{b}.attn_output.weight", e, q_rows)
        if spec.arch == "gpt-oss":
            yield vector(f"{b}.attn_output.bias", e, 0.0, 0.1)
            yield vector(f"{b}.attn_sinks.weight", spec.n_head, 0.0, 1.0)
        if not spec.n_expert:
            yield matrix("ffn_down", f"{b}.ffn_down.weight", e, ff)


def _expert_tensors(spec: SynthSpec, b: str, matrix, vector):
    """A layer's router and merged experts (and qwen2moe's shared expert), as the converter writes them:
    the router kept F32 (llama.cpp's quantizer never quantizes it) unless tensor_types names it."""
    e, E, ff = spec.n_embd, spec.n_expert, _ff_exp(spec)
    oai = spec.arch == "gpt-oss"  # its gate and up turned up (x3) so that its clamp at 7 bites now and then
    yield matrix("ffn_gate_inp", f"{b}.ffn_gate_inp.weight", E, e, default="F32")
    yield matrix("ffn_gate_exps", f"{b}.ffn_gate_exps.weight", ff, e, 3 * e ** -0.5 if oai else None, stack=(E,))
    yield matrix("ffn_up_exps", f"{b}.ffn_up_exps.weight", ff, e, 3 * e ** -0.5 if oai else None, stack=(E,))
    yield matrix("ffn_down_exps", f"{b}.ffn_down_exps.weight", e, ff, stack=(E,))
    if oai:  # biases: the router's [E], the experts' as [E, rows] stacks
        yield vector(f"{b}.ffn_gate_inp.bias", E, 0.0, 0.1)
        for name, rows in (("ffn_gate_exps", ff), ("ffn_up_exps", ff), ("ffn_down_exps", e)):
            yield f"{b}.{name}.bias", _random(spec.seed, f"{b}.{name}.bias", (E, rows), 0.1), T.F32
    if spec.arch == "qwen2moe":
        sh = spec.n_ff_shexp or spec.n_ff
        yield vector(f"{b}.ffn_gate_inp_shexp.weight", e, 0.0, e ** -0.5)
        yield matrix("ffn_gate_shexp", f"{b}.ffn_gate_shexp.weight", sh, e)
        yield matrix("ffn_up_shexp", f"{b}.ffn_up_shexp.weight", sh, e)
        yield matrix("ffn_down_shexp", f"{b}.ffn_down_shexp.weight", e, sh)


_OWN_HEAD_SIZE = ("qwen3", "gemma2", "gemma3", "qwen3moe", "gpt-oss", "gemma4")  # their converters always write attention.key_length


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permutation of llama Q/K rows: within each head, rows (i, i + d/2) of the
    Hugging Face layout become the adjacent rows (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random(seed: int, name: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
    # Seeded per tensor name, so one tensor's values do not depend on which others are written.
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(scale)  # in place: large models are written too
    return values

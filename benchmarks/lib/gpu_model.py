"""Random-weight GGUF files of a real model's shape for `speed.py gpu`, written fast enough for a GPU lease.

pyplugin.model.synth fits each block to random floats (numpy, one core): minutes for 8B parameters. Here
the blocks themselves are drawn at random, streamed tensor by tensor to the file: Q4_K and Q6_K blocks of
random quants and sub-block scales under one fixed fp16 scale per block, F16 values of random sign and
mantissa in [1/128, 1/64), F32 norms near 1. Values are of the size a 4096-wide layer's weights have, so
activations stay finite through 32 layers; what the model computes is meaningless, how fast it does is
what is measured. Other types (a shape whose rows are not whole K-blocks) go through synth's quantizer.
The metadata and tokenizer are synth's, so pebbling (and llama.cpp) load these files like any other.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from lib.shapes import q4_k_m, with_layers
from pyplugin.model.synth import SynthSpec, _add_hparams, _add_vocab, build_vocab
from pyplugin.model.synth_quant import quantize
from pyplugin.model.tokenizer import UNUSED

T = GGMLQuantizationType

SHAPES = {
    # Llama-3-8B: 32 layers of 4096, 32 heads of 128, 8 KV heads, FFN 14336, vocabulary 128256.
    "llama3-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, vocab="llama3",
                      vocab_size=128256, rope_theta=500000.0),
    # The same structure at a size a CPU machine runs in seconds (checks of the script itself).
    "tiny": dict(arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab="llama3",
                 vocab_size=2048),
}


def q4_k_m_untied(shape: dict) -> dict:
    """llama.cpp's Q4_K_M mix (shapes.q4_k_m) for a model with an output matrix of its own:
    the token embedding in the base type and the output in Q6_K, as Llama-3-8B's Q4_K_M file has them."""
    mix = q4_k_m(shape)
    return dict(mix, tensor_types={**mix["tensor_types"], "token_embd": mix["weight_type"], "output": "Q6_K"})


TYPES = {"Q4_K_M": q4_k_m_untied, "F16": lambda shape: dict(weight_type="F16")}


def spec_for(shape: str, type_name: str, n_layer: int | None, n_ctx: int) -> SynthSpec:
    base = with_layers(SHAPES[shape], n_layer)
    return SynthSpec(**base, **TYPES[type_name](base), n_ctx=n_ctx, n_merges=300,
                     name=f"pebbling bench {shape} {type_name} (random weights)")


def tensor_list(spec: SynthSpec, n_vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
    """(name, shape [rows, cols] or [n], type) of every tensor of a llama-family file, as synth names them."""
    e, ff, hd = spec.n_embd, spec.n_ff, spec.head_dim
    q_rows, kv_rows = spec.n_head * hd, spec.n_head_kv * hd

    def kind(role: str, name: str) -> str:
        return spec.tensor_types.get(name, spec.tensor_types.get(role, spec.weight_type))

    out = [("token_embd.weight", (n_vocab, e), kind("token_embd", "token_embd")),
           ("output_norm.weight", (e,), "F32"), ("output.weight", (n_vocab, e), kind("output", "output"))]
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (e,), "F32"), (f"{b}.ffn_norm.weight", (e,), "F32")]
        for role, rows, cols in (("attn_q", q_rows, e), ("attn_k", kv_rows, e), ("attn_v", kv_rows, e),
                                 ("ffn_gate", ff, e), ("ffn_up", ff, e), ("attn_output", e, q_rows),
                                 ("ffn_down", e, ff)):
            out.append((f"{b}.{role}.weight", (rows, cols), kind(role, f"{b}.{role}")))
    return out


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], type_name: str) -> np.ndarray:
    """The tensor's bytes (uint8 blocks for quantized types, else its float array)."""
    qtype = T[type_name]
    if qtype == T.F32:
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if qtype == T.F16:
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        bits &= 0x83FF                       # sign and mantissa random
        bits |= np.uint16(8 << 10)           # exponent 8: |x| in [2^-7, 2^-6)
        return bits.view(np.float16)
    rows, cols = shape
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype not in (T.Q4_K, T.Q6_K):
        return quantize(rng.standard_normal(shape, dtype=np.float32) * np.float32(cols ** -0.5), qtype)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    if qtype == T.Q4_K:   # d, dmin (fp16), then 12 bytes of 6-bit scales and mins, then 128 of nibbles
        d = np.float16(1.0 / (262 * np.sqrt(cols)))   # values of standard deviation cols^-1/2
        blocks[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(d * 7.5).tobytes(), np.uint8)  # mins offset the mean
    else:                 # Q6_K: ql 128, qh 64, 16 int8 scales, d (fp16)
        blocks[:, 192:208] &= 0x0F           # scales 0..15
        d = np.float16(1.0 / (163 * np.sqrt(cols)))
        blocks[:, 208:210] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, cols // block * size)


def write_model(path: Path, spec: SynthSpec, seed: int = 0) -> Path:
    """Writes spec's file to path, one tensor in memory at a time; returns the path."""
    vocab = build_vocab(spec.vocab, spec.n_merges, spec.pre, spec.vocab_size)
    if spec.vocab_size > len(vocab.tokens):
        pad = spec.vocab_size - len(vocab.tokens)
        vocab = replace(vocab, tokens=vocab.tokens + [f"[PAD{i}]" for i in range(pad)], types=vocab.types + [UNUSED] * pad,
                        scores=None if vocab.scores is None else vocab.scores + [0.0] * pad)
    tensors = tensor_list(spec, len(vocab.tokens))
    writer = GGUFWriter(path, spec.arch)
    _add_hparams(writer, spec, len(vocab.tokens))
    _add_vocab(writer, vocab, spec)
    nbytes = {}
    for name, shape, type_name in tensors:   # the sizes first: the header lists every tensor
        qtype = T[type_name]
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape))
        nbytes[name] = count * (4 if qtype == T.F32 else 2) if qtype in (T.F32, T.F16) else count // block * size
        dtype = {T.F32: np.float32, T.F16: np.float16}.get(qtype, np.uint8)
        byte_shape = shape if dtype is not np.uint8 else (shape[0], shape[1] // block * size)
        writer.add_tensor_info(name, byte_shape, np.dtype(dtype), nbytes[name],
                               raw_dtype=None if dtype is not np.uint8 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, type_name in tensors:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        data = random_tensor(rng, shape, type_name)
        assert data.nbytes == nbytes[name], (name, data.nbytes, nbytes[name])
        writer.write_tensor_data(data)
    writer.close()
    return path

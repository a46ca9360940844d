"""The tensor types llama-quantize gives each matrix of a file of a mix (Q2_K, Q3_K_M, IQ4_XS, MXFP4_MOE), for
synthetic files laid out as real ones are: most matrices of the mix's type, some of more bits by role and
layer, and the types it falls back to where a row is not whole blocks.

The rules are llama.cpp's (src/llama-quant.cpp, llama_tensor_get_type) for a model without an importance
matrix, neither Falcon nor a 70B, for these mixes only; a test that means a mix of another file writes its
tensor_types itself.
"""

from __future__ import annotations

from dataclasses import replace

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .synth import SynthSpec, _ff_exp

MIXES = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "IQ4_XS": "IQ4_XS", "MXFP4_MOE": "MXFP4"}  # mix -> its main type

# llama.cpp's fallback where a row is not whole blocks of the type chosen (tensor_type_fallback); F16 where
# the fallback's 32-value blocks do not fit either.
_FALLBACK = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _block(type_name: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def _fitting(type_name: str, cols: int) -> str:
    if cols % _block(type_name) == 0:
        return type_name
    fallback = _FALLBACK.get(type_name, "F16")
    return fallback if cols % _block(fallback) == 0 else "F16"


def quantize_mix(spec: SynthSpec, mix: str) -> SynthSpec:
    """`spec` with weight_type and tensor_types (every matrix by name) as llama-quantize writes `mix`:

    - Q2_K: attn_v Q3_K (Q4_K where 4 or more query heads share a KV head), attn_output and ffn_down Q3_K.
    - Q3_K_M: attn_v Q5_K in the first two layers and Q4_K after, attn_output (and phi3's attn_qkv) Q4_K,
      ffn_down Q5_K in the first n_layer/16 layers and Q4_K after.
    - IQ4_XS: attn_v Q5_K where 4 or more query heads share a KV head, ffn_down Q5_K in the first n_layer/8.
    - MXFP4_MOE: the experts' matrices MXFP4, every other matrix Q8_0 (the output and embedding too).

    The output matrix (and a tied embedding) Q6_K, or Q8_0 where its rows are not whole blocks of the mix's
    type; the embedding the mix's type; a matrix whose rows are not whole blocks of its type falls back
    (IQ4_XS to IQ4_NL, Q2_K and Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), or to F16."""
    if mix not in MIXES:
        raise ValueError(f"mix {mix!r}: choose one of {', '.join(MIXES)}")
    if spec.n_expert and mix != "MXFP4_MOE":
        raise ValueError(f"{mix} of a model with experts is not written here: llama.cpp's rules for experts differ")
    base, e, n = MIXES[mix], spec.n_embd, spec.n_layer
    gqa4 = spec.n_head // spec.n_head_kv >= 4
    moe = mix == "MXFP4_MOE"
    types: dict[str, str] = {}

    def put(name: str, type_name: str, cols: int) -> None:
        types[name] = _fitting(type_name, cols)

    output = "Q8_0" if moe or e % _block(base) else "Q6_K"
    put("output", output, e)
    put("token_embd", output if spec.tied_output else "Q8_0" if moe else base, e)
    for i in range(n):
        b = f"blk.{i}"
        if moe:
            ff = _ff_exp(spec)
            for name, cols in (("attn_q", e), ("attn_k", e), ("attn_v", e), ("attn_output", spec.n_head * spec.head_dim),
                               ("ffn_gate_shexp", e), ("ffn_up_shexp", e), ("ffn_down_shexp", spec.n_ff_shexp or spec.n_ff)):
                put(f"{b}.{name}", "Q8_0", cols)
            for name, cols in (("ffn_gate_exps", e), ("ffn_up_exps", e), ("ffn_down_exps", ff)):
                put(f"{b}.{name}", "MXFP4", cols)
            continue
        attn_v = {"Q2_K": "Q4_K" if gqa4 else "Q3_K", "Q3_K_M": "Q5_K" if i < 2 else "Q4_K",
                  "IQ4_XS": "Q5_K" if gqa4 else base}[mix]
        ffn_down = {"Q2_K": "Q3_K", "Q3_K_M": "Q5_K" if i < n // 16 else "Q4_K",
                    "IQ4_XS": "Q5_K" if i < n // 8 else base}[mix]
        attn_output = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "IQ4_XS": base}[mix]
        if spec.arch == "phi3":
            put(f"{b}.attn_qkv", "Q4_K" if mix == "Q3_K_M" else base, e)
            put(f"{b}.ffn_up", base, e)
        else:
            put(f"{b}.attn_q", base, e)
            put(f"{b}.attn_k", base, e)
            put(f"{b}.attn_v", attn_v, e)
            put(f"{b}.ffn_gate", base, e)
            put(f"{b}.ffn_up", base, e)
        put(f"{b}.attn_output", attn_output, spec.n_head * spec.head_dim)
        put(f"{b}.ffn_down", ffn_down, spec.n_ff)
    return replace(spec, weight_type=_fitting(base, e), tensor_types=types)

"""Synthetic Gemma 4 files (pyplugin.model.synth with arch "gemma4"): the tensors and keys llama.cpp's converter
writes for each variant, set by SynthSpec.gemma4 (a dict, every key optional):

- ``head_dim_swa``: the sliding layers' head size (the full layers' is SynthSpec.key_length); default key_length // 2
- ``n_head_kv_full``: the full layers' KV heads where they differ (head_count_kv becomes one per layer)
- ``shared_kv_layers``: the last layers that read earlier layers' caches (E2B, E4B)
- ``n_embd_per_layer``: the per-layer embeddings' width (E2B, E4B); 0 none
- ``double_wide``: the layers that read others' caches have an FFN twice as wide (E2B)
- ``k_eq_v``: full layers without attn_v, V their keys' projection (26B-A4B, 31B)
- ``merged_gate_up``: experts' gate and up as one ffn_gate_up_exps tensor (else split)
- ``partial_rotary``: the share of a full layer's head its proportional RoPE turns (0.25)
SynthSpec.swa_pattern (a list of true/false, one per layer) says which layers slide; n_expert > 0 gives the
26B-A4B's layer of a dense FFN beside experts.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

T = GGMLQuantizationType


def options(spec: Any) -> dict[str, Any]:
    o = dict(head_dim_swa=spec.head_dim // 2, n_head_kv_full=None, shared_kv_layers=0, n_embd_per_layer=0,
             double_wide=False, k_eq_v=False, merged_gate_up=True, partial_rotary=0.25)
    unknown = set(spec.gemma4) - set(o)
    if unknown:
        raise ValueError(f"SynthSpec.gemma4: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(o)}")
    return {**o, **spec.gemma4}


def _sliding(spec: Any) -> list[bool]:
    if not isinstance(spec.swa_pattern, list) or len(spec.swa_pattern) != spec.n_layer:
        raise ValueError("a gemma4 SynthSpec needs swa_pattern: one true/false per layer (which layers slide)")
    return spec.swa_pattern


def _layer_shape(spec: Any, o: dict[str, Any], i: int) -> tuple[int, int, int, bool, bool]:
    """Layer i's (head size, KV heads, FFN width, reads another's caches, has attn_v)."""
    sliding = _sliding(spec)[i]
    reader = o["shared_kv_layers"] > 0 and i >= spec.n_layer - o["shared_kv_layers"]
    hd = o["head_dim_swa"] if sliding else spec.head_dim
    kv = spec.n_head_kv if sliding or not o["n_head_kv_full"] else o["n_head_kv_full"]
    ff = spec.n_ff * (2 if reader and o["double_wide"] else 1)
    return hd, kv, ff, reader, not reader and (sliding or not o["k_eq_v"])


def add_hparams(w: GGUFWriter, spec: Any) -> None:
    """The keys a gemma4 file adds (or gives per layer), over those synth wrote."""
    o, arch, n = options(spec), "gemma4", spec.n_layer
    shapes = [_layer_shape(spec, o, i) for i in range(n)]

    def put(key: str, value: Any, kind: GGUFValueType) -> None:
        w.kv_data[0].pop(f"{arch}.{key}", None)
        w.add_key_value(f"{arch}.{key}", value, kind, sub_type=GGUFValueType.UINT32 if kind == GGUFValueType.ARRAY
                        and not isinstance(value[0], bool) else None)

    put("attention.key_length_swa", o["head_dim_swa"], GGUFValueType.UINT32)
    put("attention.value_length_swa", o["head_dim_swa"], GGUFValueType.UINT32)
    put("rope.dimension_count", spec.head_dim, GGUFValueType.UINT32)  # proportional: rope_freqs stops the rest
    put("rope.dimension_count_swa", o["head_dim_swa"], GGUFValueType.UINT32)
    put("attention.shared_kv_layers", o["shared_kv_layers"], GGUFValueType.UINT32)
    put("embedding_length_per_layer_input", o["n_embd_per_layer"], GGUFValueType.UINT32)
    if o["double_wide"]:
        put("feed_forward_length", [s[2] for s in shapes], GGUFValueType.ARRAY)
    if o["n_head_kv_full"]:
        put("attention.head_count_kv", [s[1] for s in shapes], GGUFValueType.ARRAY)


def tensors(spec: Any, n_vocab: int, matrix, vector, random) -> Iterable[tuple[str, Any, GGMLQuantizationType]]:
    """Every tensor of a gemma4 file, as its converter names them (the output tied to token_embd)."""
    o, e = options(spec), spec.n_embd
    n_pl = o["n_embd_per_layer"]
    yield matrix("token_embd", "token_embd.weight", n_vocab, e, e ** -0.5)
    yield vector("output_norm.weight", e, 1.0, 0.1)
    turned = int(spec.head_dim * o["partial_rotary"] / 2)
    yield "rope_freqs.weight", np.array([1.0] * turned + [1e30] * (spec.head_dim // 2 - turned), np.float32), T.F32
    if n_pl:
        yield matrix("per_layer_token_embd", "per_layer_token_embd.weight", n_vocab, spec.n_layer * n_pl, n_pl ** -0.5)
        yield matrix("per_layer_model_proj", "per_layer_model_proj.weight", spec.n_layer * n_pl, e)
        yield vector("per_layer_proj_norm.weight", n_pl, 1.0, 0.1)
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        hd, kv, ff, reader, has_v = _layer_shape(spec, o, i)
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            yield vector(f"{b}.{norm}.weight", e, 1.0, 0.1)
        yield matrix("attn_q", f"{b}.attn_q.weight", spec.n_head * hd, e)
        # q unscaled (its norm's weights do it, learned): weights of about 1/sqrt(head size), so that the scores
        # spread as 1/sqrt(d) attention's do rather than sqrt(d) times wider
        yield vector(f"{b}.attn_q_norm.weight", hd, hd ** -0.5, 0.1 * hd ** -0.5)
        if not reader:
            yield matrix("attn_k", f"{b}.attn_k.weight", kv * hd, e)
            yield vector(f"{b}.attn_k_norm.weight", hd, 1.0, 0.1)
        if has_v:
            yield matrix("attn_v", f"{b}.attn_v.weight", kv * hd, e)
        yield matrix("attn_output", f"{b}.attn_output.weight", e, spec.n_head * hd)
        yield matrix("ffn_gate", f"{b}.ffn_gate.weight", ff, e)
        yield matrix("ffn_up", f"{b}.ffn_up.weight", ff, e)
        yield matrix("ffn_down", f"{b}.ffn_down.weight", e, ff)
        yield vector(f"{b}.layer_output_scale.weight", 1, 0.75, 0.1)
        if n_pl:
            yield matrix("inp_gate", f"{b}.inp_gate.weight", n_pl, e)
            yield matrix("proj", f"{b}.proj.weight", e, n_pl)
            yield vector(f"{b}.post_norm.weight", e, 1.0, 0.1)
        if spec.n_expert:
            yield from _experts(spec, o, b, matrix, vector)


def _experts(spec: Any, o: dict[str, Any], b: str, matrix, vector):
    e, E, ff = spec.n_embd, spec.n_expert, spec.n_ff_exp or max(1, spec.n_ff // spec.n_expert_used)
    # The router scores x normed and divided by sqrt(n_embd): weights of 3 per element give scores of about 3 apart,
    # the spread of a trained router's, so that rounding does not decide which experts run
    yield matrix("ffn_gate_inp", f"{b}.ffn_gate_inp.weight", E, e, 3.0, default="F32")
    yield vector(f"{b}.ffn_gate_inp.scale", e, 1.0, 0.1)
    for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
        yield vector(f"{b}.{norm}.weight", e, 1.0, 0.1)
    if o["merged_gate_up"]:
        yield matrix("ffn_gate_up_exps", f"{b}.ffn_gate_up_exps.weight", 2 * ff, e, stack=(E,))
    else:
        yield matrix("ffn_gate_exps", f"{b}.ffn_gate_exps.weight", ff, e, stack=(E,))
        yield matrix("ffn_up_exps", f"{b}.ffn_up_exps.weight", ff, e, stack=(E,))
    yield matrix("ffn_down_exps", f"{b}.ffn_down_exps.weight", e, ff, stack=(E,))
    yield vector(f"{b}.ffn_down_exps.scale", E, 1.0, 0.2)

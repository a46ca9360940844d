"""The tests' float64 reference for Gemma 4, recomputed from scratch over the whole sequence from a GGUF file's
tensors, as llama.cpp's gemma4 graph computes it (written apart from pyplugin's forward pass): per-layer head sizes,
KV heads and FFN widths, proportional RoPE through rope_freqs on full layers, V normed without a weight (V the
keys' projection where a layer has no attn_v), q unscaled, the last layers attending over the K and V an earlier
layer of their kind computed, per-layer embeddings, the layer's output scale, the 26B-A4B's dense FFN beside
experts, the final soft cap."""

from __future__ import annotations

import math

import numpy as np

from pyplugin.model.gguf_file import GGUFFile


def gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gemma4_logits(path, tokens: list[int]) -> np.ndarray:
    """float64 logits [T, n_vocab] of every position."""
    with GGUFFile(path) as f:
        md, t = f.metadata, {name: f.dequantize(name).astype(np.float64) for name in f.tensors}
    key = lambda k, default=None: md.get(f"gemma4.{k}", default)  # noqa: E731
    per_layer = lambda k, i: key(k)[i] if isinstance(key(k), list) else key(k)  # noqa: E731
    n_layer, e, n_head = key("block_count"), key("embedding_length"), key("attention.head_count")
    eps, window = key("attention.layer_norm_rms_epsilon"), key("attention.sliding_window")
    sliding = key("attention.sliding_window_pattern")
    first_reader = n_layer - key("attention.shared_kv_layers", 0)
    n_pl = key("embedding_length_per_layer_input", 0)
    T, pos = len(tokens), np.arange(len(tokens), dtype=np.float64)

    def rms(x, w=None):
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        return y if w is None else y * w

    def rope(x, i):  # NeoX pairs (j, j + n/2) over the first n dims of each head
        hd = x.shape[-1]
        n = key("rope.dimension_count_swa") if sliding[i] else key("rope.dimension_count")
        theta = key("rope.freq_base_swa", 10000.0) if sliding[i] else key("rope.freq_base")
        factors = np.ones(n // 2) if sliding[i] else t["rope_freqs.weight"]
        ang = pos[:, None] * (theta ** (-np.arange(n // 2) * 2.0 / n) / factors)[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :n // 2], x[..., n // 2:n]
        return np.concatenate([a * c - b * s, b * c + a * s, x[..., n:hd]], -1)

    x = t["token_embd.weight"][tokens] * math.sqrt(e)
    if n_pl:
        rows = t["per_layer_token_embd.weight"][tokens].reshape(T, n_layer, n_pl) * math.sqrt(n_pl)
        proj = (x @ t["per_layer_model_proj.weight"].T / math.sqrt(e)).reshape(T, n_layer, n_pl)
        inputs = (rms(proj, t["per_layer_proj_norm.weight"]) + rows) / math.sqrt(2)
    kv_of = {}  # layer -> its (K, V) [T, heads, hd]
    for i in range(n_layer):
        b = lambda n: t[f"blk.{i}.{n}.weight"]  # noqa: E731
        hd = key("attention.key_length_swa") if sliding[i] else key("attention.key_length")
        h = rms(x, b("attn_norm"))
        q = rope(rms((h @ b("attn_q").T).reshape(T, n_head, hd), b("attn_q_norm")), i)
        if i < first_reader:
            k_raw = (h @ b("attn_k").T).reshape(T, -1, hd)
            v = (h @ b("attn_v").T).reshape(T, -1, hd) if f"blk.{i}.attn_v.weight" in t else k_raw
            kv_of[i] = rope(rms(k_raw, b("attn_k_norm")), i), rms(v)
            k, v = kv_of[i]
        else:  # the last earlier layer of its kind: llama.cpp's n_layer_kv - 2 (sliding) or - 1 (full)
            k, v = kv_of[first_reader - (2 if sliding[i] else 1)]
        group = n_head // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k)  # no scaling: the norms do it
        qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
        scores = np.where((ki <= qi) & ((qi - ki < window) | (not sliding[i])), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", p, v).reshape(T, -1) @ b("attn_output").T
        x = x + rms(attn, b("post_attention_norm"))
        dense = (gelu(rms(x, b("ffn_norm")) @ b("ffn_gate").T) * (rms(x, b("ffn_norm")) @ b("ffn_up").T)) \
            @ b("ffn_down").T
        if f"blk.{i}.ffn_gate_inp.weight" in t:
            out = rms(dense, b("post_ffw_norm_1")) + rms(_experts(t, i, x, key, rms, b), b("post_ffw_norm_2"))
        else:
            out = dense
        x = x + rms(out, b("post_ffw_norm"))
        if n_pl:
            g = gelu(x @ b("inp_gate").T) * inputs[:, i]
            x = x + rms(g @ b("proj").T, b("post_norm"))
        if f"blk.{i}.layer_output_scale.weight" in t:
            x = x * b("layer_output_scale")[0]
    logits = rms(x, t["output_norm.weight"]) @ t.get("output.weight", t["token_embd.weight"]).T
    cap = key("final_logit_softcapping", 30.0)  # llama.cpp's default for gemma4
    return cap * np.tanh(logits / cap) if cap else logits


def _experts(t, i, x, key, rms, b):
    """The experts half of a 26B-A4B layer: the router over x normed without a weight, / sqrt(n_embd), times its
    scale; a softmax over all experts, the k best, renormalised; each a GELU FFN of x normed by pre_ffw_norm_2,
    its output times its own scale."""
    E, k_used, e = key("expert_count"), key("expert_used_count"), x.shape[-1]
    logits = (rms(x) / math.sqrt(e) * t[f"blk.{i}.ffn_gate_inp.scale"]) @ b("ffn_gate_inp").T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    h = rms(x, b("pre_ffw_norm_2"))
    if f"blk.{i}.ffn_gate_up_exps.weight" in t:
        gate_up = b("ffn_gate_up_exps")   # [E, 2 ff, e]: each expert's gate rows, then its up rows
        ff = gate_up.shape[1] // 2
        gates, ups = gate_up[:, :ff], gate_up[:, ff:]
    else:
        gates, ups = b("ffn_gate_exps"), b("ffn_up_exps")
    downs, scales = b("ffn_down_exps"), t.get(f"blk.{i}.ffn_down_exps.scale", np.ones(E))
    out = np.zeros_like(x)
    for r in range(len(x)):
        chosen = np.argsort(-probs[r], kind="stable")[:k_used]
        w = probs[r, chosen] / probs[r, chosen].sum()
        for j, wj in zip(chosen, w):
            out[r] += wj * scales[j] * (downs[j] @ (gelu(gates[j] @ h[r]) * (ups[j] @ h[r])))
    return out

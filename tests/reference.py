"""The tests' float64 reference: every architecture's block as its paper and llama.cpp describe it, from a
GGUF file's tensors, recomputed from scratch over the whole sequence (dense and mixture-of-experts FFNs)."""

from __future__ import annotations

import math

import numpy as np

from pyplugin.model.gguf_file import GGUFFile


def reference_logits(path, tokens: list[int]) -> np.ndarray:
    """float64 logits [T, n_vocab] of every position, recomputed from scratch over the whole sequence."""
    with GGUFFile(path) as f:
        md, t = f.metadata, {name: f.dequantize(name).astype(np.float64) for name in f.tensors}
    arch = md["general.architecture"]
    key = lambda k, default=None: md.get(f"{arch}.{k}", default)  # noqa: E731
    n_layer, n_embd, n_head = key("block_count"), key("embedding_length"), key("attention.head_count")
    n_kv, eps = key("attention.head_count_kv"), key("attention.layer_norm_rms_epsilon")
    hd = key("attention.key_length", n_embd // n_head)
    gemma = arch.startswith("gemma")
    window = key("attention.sliding_window", 0)
    period = key("attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}.get(arch, 0))
    sliding = [bool(window) and (period == 0 or i % period < period - 1) for i in range(n_layer)]
    factor = key("rope.scaling.factor", 1.0) if key("rope.scaling.type") == "linear" else 1.0
    scale_q = key("attention.scale") or 1.0 / math.sqrt(hd)
    res_scale = key("residual_scale", 1.0)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos, theta, freq_scale, factors):  # x [T, heads, hd]; NeoX pairs (j, j+hd/2), llama (2j, 2j+1)
        half = hd // 2
        inv = freq_scale * theta ** (-np.arange(half) * 2.0 / hd) / factors
        ang = pos[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
            return out
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    T, pos = len(tokens), np.arange(len(tokens), dtype=np.float64)
    x = t["token_embd.weight"][tokens] * (math.sqrt(n_embd) if gemma else key("embedding_scale", 1.0))
    factors = t.get("rope_freqs.weight", np.ones(hd // 2))
    for i in range(n_layer):
        b = lambda n: t[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = rms(x, b("attn_norm"))
        q, k, v = ((h @ b(n).T + t.get(f"blk.{i}.{n}.bias", 0)).reshape(T, -1, hd)
                   for n in ("attn_q", "attn_k", "attn_v"))
        if f"blk.{i}.attn_q_norm.weight" in t:
            q, k = rms(q, b("attn_q_norm")), rms(k, b("attn_k_norm"))
        if sliding[i] and arch == "gemma3":
            theta, fs = key("rope.freq_base_swa", 10000.0), 1.0
        else:
            theta, fs = key("rope.freq_base"), 1.0 / factor
        q, k = rope(q, pos, theta, fs, factors), rope(k, pos, theta, fs, factors)
        if gemma:
            scale_q = 1.0 / math.sqrt(hd)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q * scale_q, k)
        cap = key("attn_logit_softcapping", 50.0) if arch == "gemma2" else 0.0  # llama.cpp's default
        if cap:
            scores = cap * np.tanh(scores / cap)
        qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
        visible = (ki <= qi) & (~sliding[i] | (qi - ki < max(window, 1)))
        scores = np.where(visible, scores, -np.inf)
        sinks = f"blk.{i}.attn_sinks.weight" in t  # gpt-oss: one more score per head, weighting no value
        if sinks:
            scores = np.concatenate([scores, np.broadcast_to(b("attn_sinks")[:, None, None], (n_head, T, 1))], -1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        if sinks:
            p = p[..., :-1]
        o = np.einsum("hqk,khd->qhd", p, v).reshape(T, -1) @ b("attn_output").T + t.get(f"blk.{i}.attn_output.bias", 0)
        if gemma:
            o = rms(o, b("post_attention_norm"))
        x = x + o * res_scale
        h = rms(x, b("post_attention_norm" if arch == "gpt-oss" else "ffn_norm"))
        if f"blk.{i}.ffn_gate_inp.weight" in t:
            o = experts_ffn(h, b, key, arch, f"blk.{i}.ffn_gate_shexp.weight" in t,
                            lambda n: t.get(f"blk.{i}.{n}.bias"))
        else:
            g = h @ b("ffn_gate").T
            g = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) if gemma else silu(g)
            o = (g * (h @ b("ffn_up").T)) @ b("ffn_down").T
        if gemma:
            o = rms(o, b("post_ffw_norm"))
        x = x + o * res_scale
    out = t.get("output.weight", t["token_embd.weight"])
    logits = rms(x, t["output_norm.weight"]) @ out.T / key("logit_scale", 1.0)
    cap = key("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0)
    return cap * np.tanh(logits / cap) if cap else logits


def silu(x):
    return x / (1 + np.exp(-x))


def experts_ffn(h, b, key, arch: str, shared: bool, bias=lambda name: None):
    """A layer of experts on h [T, n_embd]: a softmax over every expert, the k most probable, renormalised
    where the model says (qwen2moe: not, unless expert_weights_norm), scaled by expert_weights_scale; each
    chosen expert's gated FFN (slice j of each merged [n_expert, ...] tensor) weighted; qwen2moe's shared
    expert after, through its sigmoid gate. gpt-oss: the router's and the experts' biases (`bias(name)`), the
    k highest scores with a softmax over those alone, and its clamped SwiGLU."""
    k_used = key("expert_used_count")
    normalise = key("expert_weights_norm", arch != "qwen2moe")
    scale = key("expert_weights_scale", 0.0) or 1.0  # llama.cpp: 0 (absent) scales nothing
    oai = arch == "gpt-oss"
    logits = h @ b("ffn_gate_inp").T + (bias("ffn_gate_inp") if oai else 0)   # [T, n_expert]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for r in range(len(h)):
        chosen = np.argsort(-probs[r], kind="stable")[:k_used]
        w = probs[r, chosen] / (probs[r, chosen].sum() if normalise or oai else 1.0) * scale
        for j, wj in zip(chosen, w):
            gate, up, down = b("ffn_gate_exps")[j], b("ffn_up_exps")[j], b("ffn_down_exps")[j]
            if oai:
                g = np.minimum(gate @ h[r] + bias("ffn_gate_exps")[j], 7.0)
                u = np.clip(up @ h[r] + bias("ffn_up_exps")[j], -7.0, 7.0)
                out[r] += wj * (down @ (g / (1 + np.exp(-1.702 * g)) * (u + 1)) + bias("ffn_down_exps")[j])
                continue
            out[r] += wj * (down @ (silu(gate @ h[r]) * (up @ h[r])))
    if shared:
        o = (silu(h @ b("ffn_gate_shexp").T) * (h @ b("ffn_up_shexp").T)) @ b("ffn_down_shexp").T
        out += o / (1 + np.exp(-(h @ b("ffn_gate_inp_shexp"))))[:, None]
    return out

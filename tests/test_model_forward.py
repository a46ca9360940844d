"""The forward pass against an independent float64 reference, KV-cache decode and chunked prefill.

The reference reads the file with gguf's own reader and dequantizer and runs the textbook model the
way Hugging Face writes it, one token at a time in plain loops: llama Q/K rows are first put back in
Hugging Face order (undoing the converter's permutation) and every architecture then uses
rotate-half RoPE. Agreement therefore also checks our GGML "normal" RoPE on permuted rows.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from helpers import tiny_model, tiny_path
from pyplugin.runtime import Generation, ResidentLayers
from pyplugin.model import KVCache, ModelConfig, embed, layer_forward, output_logits
from pyplugin.runtime.options import Options

PROMPT = [3, 17, 42, 99, 7, 150, 8, 61, 5]


# ---------------------------------------------------------------------------------------------------
# the reference


def _read(path):
    reader = GGUFReader(path)
    md = {k: f.contents() for k, f in reader.fields.items()}
    weights = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)
               for t in reader.tensors}
    return md, weights


def _unpermute(w, n_head):
    """Undo convert_hf_to_gguf's llama Q/K permutation (rows 2i, 2i+1 -> i, i + d/2 per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _rms(x, w, eps):
    return x / math.sqrt(sum(v * v for v in x) / len(x) + eps) * w


def reference_logits(path, tokens):
    md, W = _read(path)
    arch = md["general.architecture"]
    a = lambda k, default=None: md.get(f"{arch}.{k}", default)  # noqa: E731
    n_layer, n_embd, n_head = a("block_count"), a("embedding_length"), a("attention.head_count")
    n_kv, n_ff = a("attention.head_count_kv"), a("feed_forward_length")
    hd = n_embd // n_head
    n_rot, eps, theta = a("rope.dimension_count", hd), a("attention.layer_norm_rms_epsilon"), a("rope.freq_base")
    scale = 1.0 / a("rope.scaling.factor", 1.0)
    factors = W.get("rope_freqs.weight", np.ones(n_rot // 2))
    inv_freq = [scale / theta ** (2 * i / n_rot) / factors[i] for i in range(n_rot // 2)]

    def rope(vec, pos):  # Hugging Face rotate_half on the first n_rot dims
        out = vec.copy()
        for i in range(n_rot // 2):
            c, s = math.cos(pos * inv_freq[i]), math.sin(pos * inv_freq[i])
            x1, x2 = vec[i], vec[i + n_rot // 2]
            out[i], out[i + n_rot // 2] = x1 * c - x2 * s, x2 * c + x1 * s
        return out

    layers = []
    for l in range(n_layer):
        b = lambda name: W.get(f"blk.{l}.{name}")  # noqa: E731
        if arch == "phi3":
            qkv = b("attn_qkv.weight")
            wq, wk, wv = qkv[:n_head * hd], qkv[n_head * hd:(n_head + n_kv) * hd], qkv[(n_head + n_kv) * hd:]
            up = b("ffn_up.weight")
            wg, wu = up[:n_ff], up[n_ff:]
        else:
            wq, wk, wv = b("attn_q.weight"), b("attn_k.weight"), b("attn_v.weight")
            wg, wu = b("ffn_gate.weight"), b("ffn_up.weight")
        if arch == "llama":
            wq, wk = _unpermute(wq, n_head), _unpermute(wk, n_kv)
        zeros = lambda n: np.zeros(n)  # noqa: E731
        layers.append(dict(wq=wq, wk=wk, wv=wv, wg=wg, wu=wu, wo=b("attn_output.weight"),
                           wd=b("ffn_down.weight"), an=b("attn_norm.weight"), fn=b("ffn_norm.weight"),
                           bq=b("attn_q.bias") if b("attn_q.bias") is not None else zeros(n_head * hd),
                           bk=b("attn_k.bias") if b("attn_k.bias") is not None else zeros(n_kv * hd),
                           bv=b("attn_v.bias") if b("attn_v.bias") is not None else zeros(n_kv * hd)))
    emb = W["token_embd.weight"]
    out_w = W.get("output.weight", emb)

    keys = [[] for _ in range(n_layer)]
    values = [[] for _ in range(n_layer)]
    all_logits = []
    for pos, tok in enumerate(tokens):
        x = emb[tok].copy()
        for l, L in enumerate(layers):
            h = _rms(x, L["an"], eps)
            q = (L["wq"] @ h + L["bq"]).reshape(n_head, hd)
            k = (L["wk"] @ h + L["bk"]).reshape(n_kv, hd)
            v = (L["wv"] @ h + L["bv"]).reshape(n_kv, hd)
            keys[l].append(np.array([rope(k[j], pos) for j in range(n_kv)]))
            values[l].append(v)
            heads = []
            for j in range(n_head):
                kv = j // (n_head // n_kv)
                qj = rope(q[j], pos)
                scores = [float(qj @ keys[l][s][kv]) / math.sqrt(hd) for s in range(pos + 1)]
                m = max(scores)
                p = [math.exp(sc - m) for sc in scores]
                heads.append(sum(p[s] * values[l][s][kv] for s in range(pos + 1)) / sum(p))
            x = x + L["wo"] @ np.concatenate(heads)
            h = _rms(x, L["fn"], eps)
            g = L["wg"] @ h
            x = x + L["wd"] @ (g / (1 + np.exp(-g)) * (L["wu"] @ h))
        all_logits.append(out_w @ _rms(x, W["output_norm.weight"], eps))
    return np.array(all_logits)


def our_logits(model, tokens, kv_type="f32"):
    cfg = model.config
    kv = KVCache.allocate(cfg, 64, kv=kv_type)
    x = embed(model.outer, tokens)
    for i, lw in enumerate(model.layers):
        x = layer_forward(cfg, x, lw, kv.k[i], kv.v[i], 0)
    return output_logits(cfg, model.outer, x)


def assert_close(ours, ref, rel=1e-4):
    np.testing.assert_allclose(ours, ref, rtol=rel, atol=rel * np.abs(ref).max())


# ---------------------------------------------------------------------------------------------------
# tests


FORWARD_CASES = [
    pytest.param("llama", {}, id="llama-gqa"),
    pytest.param("llama", dict(n_head_kv=4), id="llama-mha"),
    pytest.param("llama", dict(rope_linear_factor=4.0, rope_theta=500000.0), id="llama-linear-scaling"),
    pytest.param("llama", dict(rope_freqs=True), id="llama-rope-freqs"),
    pytest.param("llama", dict(tied_output=True), id="llama-tied-output"),
    pytest.param("llama", dict(weight_type="Q4_K"), id="llama-q4k"),
    pytest.param("llama", dict(weight_type="Q5_K"), id="llama-q5k"),
    pytest.param("llama", dict(weight_type="Q4_1"), id="llama-q4_1"),
    pytest.param("qwen2", {}, id="qwen2-biases"),
    pytest.param("qwen2", dict(rope_dims=8, weight_type="Q8_0"), id="qwen2-partial-rope-q8"),
    pytest.param("qwen2", dict(tied_output=True, weight_type="BF16"), id="qwen2-tied-bf16"),
    pytest.param("qwen2", dict(weight_type="Q5_0", tensor_types={"ffn_down": "Q8_0"}), id="qwen2-q5_0"),
    pytest.param("phi3", dict(weight_type="Q5_1"), id="phi3-q5_1"),
    pytest.param("phi3", {}, id="phi3-fused"),
    pytest.param("phi3", dict(weight_type="Q6_K", n_head=8, n_head_kv=8), id="phi3-q6k"),
]


@pytest.mark.parametrize("arch,spec", FORWARD_CASES)
def test_forward_matches_float64_reference(arch, spec):
    """With float32 caches, to the reference's float32 rounding; with f16 caches (the default), within what
    rounding K and V to fp16 costs: each is off by up to 2^-11 relative, and a logit sums many of them, so
    1e-3 of the largest logit (well below any gap a greedy test relies on)."""
    model = tiny_model(arch, **spec)
    ref = reference_logits(tiny_path(arch, **spec), PROMPT)
    assert_close(our_logits(model, PROMPT), ref)
    assert_close(our_logits(model, PROMPT, "f16"), ref, rel=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_decode_with_kv_cache_equals_recomputing_the_sequence(arch):
    model = tiny_model(arch)
    options = Options(temperature=0, num_ctx=64, kv_type="f32")  # as our_logits: no rounding of K and V apart
    gen = Generation(model, options)
    logits = gen.prefill(PROMPT)
    sequence = list(PROMPT)
    for _ in range(6):
        token = int(np.argmax(logits))
        sequence.append(token)
        logits = gen.decode_one(token)
        assert_close(logits, our_logits(model, sequence)[-1], rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_chunked_prefill_equals_unchunked(arch):
    model = tiny_model(arch)
    # float32 caches: chunking changes K and V by float32 rounding, which fp16 caches could round apart
    whole = Generation(model, Options(num_ctx=64, num_batch=512, kv_type="f32"))
    chunked = Generation(model, Options(num_ctx=64, num_batch=2, kv_type="f32"))
    assert_close(chunked.prefill(PROMPT), whole.prefill(PROMPT), rel=1e-5)
    for a, b in zip(chunked.layers.kv.k + chunked.layers.kv.v, whole.layers.kv.k + whole.layers.kv.v):
        assert_close(a, b, rel=1e-5)


def test_layer_forward_writes_kv_rows_at_pos_only():
    model = tiny_model("llama")
    cfg = model.config
    kv = KVCache.allocate(cfg, 16)
    x = embed(model.outer, PROMPT[:3])
    layer_forward(cfg, x, model.layers[0], kv.k[0], kv.v[0], pos=5)
    written = np.abs(kv.k[0]).sum(axis=(1, 2)) > 0
    assert written.tolist() == [False] * 5 + [True] * 3 + [False] * 8


def test_layer_forward_refuses_positions_past_the_cache():
    model = tiny_model("llama")
    kv = KVCache.allocate(model.config, 4)
    with pytest.raises(ValueError, match="do not fit"):
        layer_forward(model.config, embed(model.outer, PROMPT[:3]), model.layers[0], kv.k[0], kv.v[0], 2)


def test_layer_source_is_what_the_loop_reads():
    model = tiny_model("llama")
    seen = []

    class Recording(ResidentLayers):
        def layer(self, i):
            seen.append(("layer", i))
            return super().layer(i)

        def done(self, i):
            seen.append(("done", i))

    Generation(model, Options(num_ctx=32), layers=Recording(model, 32)).prefill(PROMPT[:4])
    assert seen == [(step, i) for i in range(model.config.n_layer) for step in ("layer", "done")]


@pytest.mark.parametrize("window, k_pos, pos", [(0, 0, 0), (0, 0, 37), (16, 0, 0), (16, 20, 40)])
def test_a_long_prompt_s_attention_split_among_threads_equals_it_whole(monkeypatch, window, k_pos, pos):
    """A prompt's queries cut into parts of about equal work, each over the keys it sees (the causal edge,
    a sliding window, keys that start past 0 as a ring's do), give the attention of the whole."""
    import pyplugin.model.attention as transformer

    cfg = ModelConfig(arch="llama", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=64, n_vocab=8,
                      n_ctx_train=256, rms_eps=1e-6, rope_mode=0, rope_dims=16, window=window)
    rng = np.random.default_rng(3)
    T, S = 50, pos + 50 - k_pos
    q = rng.standard_normal((T, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((S, 2, 16)).astype(np.float32) for _ in range(2))
    whole = transformer.attention(cfg, q, k, v, pos, k_pos)
    for threads in (2, 3):
        monkeypatch.setattr(transformer, "_attention_threads", lambda n=threads: n)
        monkeypatch.setattr(transformer, "_SPLIT_SCORES", 0)
        monkeypatch.setattr(transformer, "_attention_pool", lru_cache(maxsize=1)(
            lambda: ThreadPoolExecutor(max_workers=2)))
        split = transformer.attention(cfg, q, k, v, pos, k_pos)
        np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-6)

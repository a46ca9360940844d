"""gpt-oss (llama.cpp's openai-moe): its own parts, each held to an independent computation and shown not to be
dead in the files the other tests run (tests/test_moe.py runs gpt-oss through the float64 reference, every
strategy, backend, batch and expert cache; tests/test_decode_step.py one layer of it through each decode step;
`benchmarks/agreement.py llamacpp --only gpt-oss` against llama.cpp): the sinks in the softmax, the clamped
SwiGLU, the softmax over the chosen experts, the file's layout read as llama.cpp reads it, and what the decode
step refuses.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from helpers import rewrite_gguf, store_backend_params, tiny_model, tiny_path
from pyplugin.errors import InvalidArgumentError, ModelError, SizeMismatchError
from pyplugin.model import load_model, moe
from pyplugin.model.attention import attention
from pyplugin.model.transformer import ModelConfig, ROPE_NEOX
from pyplugin.runtime import Generation
from pyplugin.runtime.options import Options
from pyplugin.store import backend_named

SPEC = dict(n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_ctx=128, n_layer=2, n_expert=8, n_expert_used=3,
            key_length=32, n_ff_exp=32, sliding_window=4)


def cfg_of(**extra) -> ModelConfig:
    return ModelConfig(arch="gpt-oss", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, head_dim=8, n_ff=8, n_vocab=1,
                       n_ctx_train=64, rms_eps=1e-5, rope_mode=ROPE_NEOX, rope_dims=8, **extra)


def test_the_file_reads_as_llama_cpp_reads_it():
    model = tiny_model("gpt-oss", weights="quantized", **SPEC)
    cfg, lw = model.config, model.layers[0]
    assert (cfg.activation, cfg.expert_gating, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == \
        ("swiglu_oai", "softmax_chosen", 8, 3, 32)
    assert (cfg.head_dim, cfg.n_head * cfg.head_dim, cfg.rope_mode) == (32, 128, ROPE_NEOX)  # q wider than the model
    assert (cfg.sliding_window, cfg.swa_layers) == (4, (0,))       # every other layer, the first sliding
    assert lw.attn_sinks.shape == (4,) and lw.bo.shape == (64,) and lw.ffn_gate_inp_b.shape == (8,)
    assert lw.ffn_gate_exps_b.shape == lw.ffn_up_exps_b.shape == (8 * 32,) and lw.ffn_down_exps_b.shape == (8 * 64,)
    # the norm before the experts is the file's post_attention_norm
    with_norm = load_model(tiny_path("gpt-oss", **SPEC), weights="f16", progress=False)
    from gguf import GGUFReader
    tensors = {t.name: np.array(t.data) for t in GGUFReader(tiny_path("gpt-oss", **SPEC)).tensors}
    np.testing.assert_array_equal(with_norm.layers[1].ffn_norm, tensors["blk.1.post_attention_norm.weight"])
    assert "blk.0.ffn_norm.weight" not in tensors


def test_a_gpt_oss_file_without_its_window_or_with_a_stray_tensor_is_refused(tmp_path):
    src = tiny_path("gpt-oss", **SPEC)
    no_window = rewrite_gguf(src, tmp_path / "nowindow.gguf", drop={"gpt-oss.attention.sliding_window"})
    with pytest.raises(ModelError, match="needs 'gpt-oss.attention.sliding_window'"):
        load_model(no_window, progress=False)
    stray = rewrite_gguf(src, tmp_path / "ffnnorm.gguf", tensors={"blk.0.ffn_norm.weight": np.ones(64)})
    with pytest.raises(ModelError, match=r"'blk\.0\.ffn_norm\.weight' is not part of the gpt-oss block"):
        load_model(stray, progress=False)
    sinks = rewrite_gguf(tiny_path("llama"), tmp_path / "llama-sinks.gguf", tensors={"blk.0.attn_sinks.weight": np.ones(4)})
    with pytest.raises(ModelError, match=r"'blk\.0\.attn_sinks\.weight' is not part of the llama block"):
        load_model(sinks, progress=False)


def test_sinks_join_the_softmax_and_weight_no_value():
    rng = np.random.default_rng(0)
    T, S = 3, 7
    q, k, v = rng.standard_normal((T, 4, 8), np.float32), *rng.standard_normal((2, S, 2, 8), np.float32)
    sinks = np.array([0.5, -1.0, 3.0, 0.0], np.float32)
    cfg = cfg_of()
    got = attention(cfg, q, k, v, S - T, 0, sinks).reshape(T, 4, 8)
    for t in range(T):  # by hand: the scores, one more per head, its probability dropped
        for h in range(4):
            scores = k[:S - T + t + 1, h // 2] @ (q[t, h] * cfg.query_scale)
            p = np.exp(np.append(scores, sinks[h]) - max(scores.max(), sinks[h]))
            p = p[:-1] / p.sum()
            np.testing.assert_allclose(got[t, h], p @ v[:S - T + t + 1, h // 2], rtol=1e-5, atol=1e-6)
    plain = attention(cfg, q, k, v, S - T, 0).reshape(T, 4, 8)
    assert np.abs(plain - got).max() > 1e-2                 # the sinks take probability away


def test_the_clamped_swiglu_is_llama_cpp_s():
    g = np.array([-9.0, -1.0, 0.0, 2.0, 6.9, 7.0, 12.0], np.float32)
    u = np.array([-8.0, -7.5, 0.5, 3.0, 7.0, 9.0, -12.0], np.float32)
    gc, uc = np.minimum(g, 7), np.clip(u, -7, 7)
    want = gc / (1 + np.exp(-1.702 * gc)) * (uc + 1)
    np.testing.assert_allclose(moe.swiglu_oai(g, u), want, rtol=1e-6)
    assert moe.swiglu_oai(np.float32([12.0]), np.float32([1.0]))[0] == pytest.approx(7 / (1 + np.exp(-1.702 * 7)) * 2)


def test_the_clamp_bites_in_the_files_the_other_tests_run(monkeypatch):
    """synth writes gpt-oss's gate and up three times larger, so that some gates pass 7: the reference and
    llama.cpp comparisons see the clamp."""
    seen = []
    real = moe.swiglu_oai
    monkeypatch.setattr(moe, "swiglu_oai", lambda g, u: (seen.append((np.asarray(g), np.asarray(u))), real(g, u))[1])
    model = tiny_model("gpt-oss", weights="f16", **SPEC)
    Generation(model, Options(num_ctx=64, kv_type="f32")).prefill([(5 * i + 2) % 250 + 1 for i in range(24)])
    gates, ups = np.concatenate([g.ravel() for g, _ in seen]), np.concatenate([u.ravel() for _, u in seen])
    assert (gates > 7).sum() >= 3 and (np.abs(ups) > 7).sum() >= 3, ((gates > 7).sum(), (np.abs(ups) > 7).sum())


def test_the_chosen_experts_weights_are_a_softmax_over_their_scores_alone():
    rng = np.random.default_rng(1)
    router = rng.standard_normal((8, 16)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    h = rng.standard_normal((5, 16)).astype(np.float32)
    cfg = cfg_of(n_expert=8, n_expert_used=3, n_ff_exp=4, expert_gating="softmax_chosen")
    chosen, w = moe.route(cfg, h, router, 0, bias)
    logits = h @ router.T + bias
    for r in range(5):
        top = np.argsort(-logits[r])[:3]
        np.testing.assert_array_equal(chosen[r], top)
        e = np.exp(logits[r, top] - logits[r, top].max())
        np.testing.assert_allclose(w[r], e / e.sum(), rtol=1e-6)
    _, unbiased = moe.route(cfg, h, router, 0)
    assert not np.allclose(unbiased, w)                    # the router's bias is read


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
def test_the_decode_step_refuses_what_it_does_not_compute_by_name(backend):
    kernels = backend_named(backend).kernels
    model = tiny_model("gpt-oss", weights="quantized", **SPEC)
    cfg, lw = replace(model.config, n_layer=1), model.layers[0]  # a sliding layer: its caches a ring of 4 rows
    outer = model.outer_weights(kernels)
    caches = [[(np.zeros((4, 2, 32), np.float32), np.zeros((4, 2, 32), np.float32))]]
    kernels.decoder(cfg, [lw], caches, outer, 32).close()  # as loaded: taken
    for change, message in [
        (dict(attn_sinks=lw.attn_sinks.astype(np.float16)), "attn_sinks must be 0 F32"),
        (dict(ffn_up_exps_b=None), "all three or none"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            kernels.decoder(cfg, [replace(lw, **change)], caches, outer, 32)
    with pytest.raises(InvalidArgumentError, match="expert_gating"):
        kernels.decoder(replace(cfg, expert_norm=True), [lw], caches, outer, 32)
    dense = tiny_model("qwen2", weights="quantized")
    dcfg, dlw = replace(dense.config, n_layer=1), dense.layers[0]
    dcaches = [[(np.zeros((32, 2, 16), np.float32), np.zeros((32, 2, 16), np.float32))]]
    with pytest.raises((InvalidArgumentError, SizeMismatchError), match="ffn_gate_inp_b"):  # (the bindings: its size)
        kernels.decoder(dcfg, [replace(dlw, ffn_gate_inp_b=np.zeros(4, np.float32))], dcaches,
                        dense.outer_weights(kernels), 32)
    with pytest.raises(InvalidArgumentError, match="activation"):
        kernels.decoder(replace(dcfg, activation="swiglu_oai"), [dlw], dcaches, dense.outer_weights(kernels), 32)

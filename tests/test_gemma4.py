"""Gemma 4 (gemma4): each variant llama.cpp loads, at reduced width with its real model's layer pattern and head
sizes in proportion, against a float64 forward pass written apart from pebbling's (reference_gemma4.py): E2B's
per-layer embeddings, last layers reading earlier layers' caches and double-wide FFNs; 26B-A4B's dense FFN beside
experts (merged or split gate and up), V = K on full layers with KV heads of their own; 31B's dense layers. Prefill
in chunks shorter and longer than the window, then decode across it; every strategy's tokens equal to full
residency's on every backend; the caches a layer reads and does not keep (the estimate and the plan count none,
the plan keeps the layers read resident); the file read as llama.cpp reads it and refused where it asks for
what is not computed.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import store_backend_params, tiny_path
from reference_gemma4 import gemma4_logits
from pyplugin.errors import ModelError
from pyplugin.model import KVCache, load_model
from pyplugin.runtime import Generation, PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions

SLIDE5 = [i % 5 < 4 for i in range(10)]   # E2B: four sliding layers, then a full one
SLIDE6 = [i % 6 < 5 for i in range(6)]    # 26B-A4B, 31B: five, then one
SHAPE = dict(n_embd=64, n_head=4, n_ff=96, n_ctx=128, n_merges=150, key_length=64, sliding_window=5,
             rope_theta=1e6)
CASES = {
    "e2b": dict(n_layer=10, n_head_kv=1, swa_pattern=SLIDE5,
                gemma4=dict(head_dim_swa=32, shared_kv_layers=5, n_embd_per_layer=16, double_wide=True)),
    "26b-a4b": dict(n_layer=6, n_head_kv=2, swa_pattern=SLIDE6, n_expert=8, n_expert_used=2, n_ff_exp=32,
                    gemma4=dict(head_dim_swa=32, n_head_kv_full=1, k_eq_v=True)),
    "26b-a4b split": dict(n_layer=6, n_head_kv=2, swa_pattern=SLIDE6, n_expert=8, n_expert_used=2, n_ff_exp=32,
                          gemma4=dict(head_dim_swa=32, n_head_kv_full=1, k_eq_v=True, merged_gate_up=False)),
    "31b": dict(n_layer=6, n_head_kv=2, swa_pattern=SLIDE6, final_softcap=20.0,
                gemma4=dict(head_dim_swa=32, n_head_kv_full=1, k_eq_v=True)),
}
PROMPT_LEN, DECODED = 13, 6


def path_of(case: str, **extra):
    return tiny_path("gemma4", **{**SHAPE, **CASES[case], **extra})


def prompt(n: int = PROMPT_LEN) -> list[int]:
    return [(7 * i + 3) % 250 + 1 for i in range(n)]


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_batch", [4, 16])  # prefill chunks shorter and longer than the window of 5
def test_prefill_and_decode_match_the_float64_reference(case, num_batch):
    path = path_of(case)
    model = load_model(path, weights="f16", progress=False)
    tokens = prompt(PROMPT_LEN + DECODED)
    ref = gemma4_logits(path, tokens)
    # float32 caches to float32's rounding; f16 caches within fp16's rounding of K and V (2^-11 relative each),
    # over 10 layers five of which read the same two caches: 5e-3 of the logits' norm. Not with experts: there
    # the caches' rounding moves a token whose router scores two experts alike to the other, a step, not noise.
    kv_types = (("f32", 1e-4),) if "n_expert" in CASES[case] else (("f32", 1e-4), ("f16", 5e-3))
    for kv_type, tolerance in kv_types:
        gen = Generation(model, Options(temperature=0, num_ctx=64, num_batch=num_batch, kv_type=kv_type))
        assert rel(gen.prefill(tokens[:PROMPT_LEN]), ref[PROMPT_LEN - 1]) < tolerance
        for n, token in enumerate(tokens[PROMPT_LEN:]):  # the caches (and the shared ones), across the window
            assert rel(gen.decode_one(token), ref[PROMPT_LEN + n]) < tolerance, (case, kv_type, n)


def test_the_reference_sees_what_gemma4_adds():
    """Each part changes the logits, so the match above is not blind to it."""
    tokens = prompt()
    base = gemma4_logits(path_of("e2b"), tokens)
    for extra in (dict(sliding_window=1024), dict(gemma4={**CASES["e2b"]["gemma4"], "n_embd_per_layer": 0}),
                  dict(gemma4={**CASES["e2b"]["gemma4"], "shared_kv_layers": 0}),
                  dict(gemma4={**CASES["e2b"]["gemma4"], "partial_rotary": 1.0})):
        assert rel(gemma4_logits(path_of("e2b", **extra), tokens), base) > 1e-3, extra


def test_the_file_reads_as_llama_cpp_reads_it():
    cfg = load_model(path_of("e2b"), progress=False).config
    assert (cfg.attn_scale, cfg.final_softcap, cfg.rope_theta_swa, cfg.activation) == (1.0, 30.0, 10000.0, "gelu")
    assert cfg.swa_layers == tuple(i for i in range(10) if SLIDE5[i])
    # llama.cpp: layers from n_layer - shared_kv_layers read layer n_layer_kv - 2 (sliding) or - 1 (full)
    assert [cfg.kv_source(i) for i in range(10)] == [0, 1, 2, 3, 4, 3, 3, 3, 3, 4]
    assert cfg.kv_owners == (0, 1, 2, 3, 4) and cfg.kv_shared == (3, 4)
    layers = [cfg.for_layer(i) for i in range(10)]
    assert [c.head_dim for c in layers] == [32, 32, 32, 32, 64] * 2
    assert [c.n_ff for c in layers] == [96] * 5 + [192] * 5     # double-wide where the caches are read
    assert [c.rope_dims for c in layers] == [32, 32, 32, 32, 64] * 2  # proportional: rope_freqs stops the rest
    assert cfg.rope_freq_factors[:8] == (1.0,) * 8 and cfg.rope_freq_factors[8] > 1e29
    moe = load_model(path_of("26b-a4b"), progress=False)
    assert [moe.config.for_layer(i).n_head_kv for i in range(6)] == [2] * 5 + [1]
    assert moe.layers[5].wv is None and moe.layers[4].wv is not None  # V = K on the full layer
    assert moe.config.expert_norm and moe.layers[0].ffn_down_exps_s.shape == (8,)


def test_a_layer_reading_another_s_caches_keeps_none():
    model = load_model(path_of("e2b"), progress=False)
    kv = KVCache.allocate(model.config, 32)
    assert kv.k[7] is kv.k[3] and kv.v[9] is kv.v[4]
    own = sum(kv.k[i].nbytes + kv.v[i].nbytes for i in range(5))
    assert kv.nbytes == own
    assert all(w.wk is None and w.k_norm is None for w in model.layers[5:])


@pytest.mark.parametrize("case", ["e2b", "26b-a4b"])
@pytest.mark.parametrize("backend", store_backend_params())
def test_every_strategy_gives_the_tokens_of_full_residency(case, backend):
    """Full residency on the backend's own kernels is the reference: the 26B-A4B's sixth token is a near-tie (its
    two best logits 3.4e-3 apart on the host's kernels, swapped by the stub's, which round otherwise)."""
    from pyplugin.runtime.generation import ResidentLayers
    from pyplugin.store import backend_named
    model = load_model(path_of(case), progress=False)
    options = Options(temperature=0, num_predict=8, num_ctx=32, num_batch=4)
    resident = ResidentLayers(model, options.num_ctx, backend_named(backend).kernels, options.kv_type)
    reference = list(Generation(model, options, layers=resident).tokens(prompt()))
    pm = PebbledModel(model, backend=backend)
    try:
        for strategy in ("none", "sqrt", "minimal", "every:3", "adaptive"):
            pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy})
            gen = pm.generation(options, pebbling, PROMPT_LEN)
            assert list(gen.tokens(prompt())) == reference, strategy
            plan = gen.layers.plan
            # the layers whose caches later ones read stay resident under every strategy
            assert set(model.config.kv_shared) <= set(plan.resident), strategy
            kv = plan.memory.layer_kv_bytes
            assert all(kv[i] == 0 for i in range(model.config.n_layer) if not model.config.owns_kv(i))
    finally:
        pm.close()


def test_refused_by_name():
    with pytest.raises(ModelError, match="reads the caches of layer"):  # a reader's source of another kind
        load_model(path_of("e2b", gemma4={**CASES["e2b"]["gemma4"], "shared_kv_layers": 4}), progress=False)
    with pytest.raises(ModelError, match="sliding_window_pattern"):
        load_model(path_of("31b", metadata={"gemma4.attention.sliding_window_pattern": 6}), progress=False)
    with pytest.raises(ModelError, match="gemma4.attention.key_length_swa"):
        load_model(path_of("31b", metadata={"gemma4.attention.key_length_swa": 0}), progress=False)
    with pytest.raises(ModelError, match="may change what the model computes"):
        load_model(path_of("31b", metadata={"gemma4.attention.k_eq_v_frobnicate": 1}), progress=False)


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
def test_experts_as_pebbles_give_the_tokens_of_none(backend):
    """The 26B-A4B's experts out of their layers (pebbling_expert_cache), under a streaming strategy too: the
    tokens of every expert kept with its layer."""
    model = load_model(path_of("26b-a4b"), progress=False)
    options = Options(temperature=0, num_predict=8, num_ctx=32, num_batch=4)
    pm = PebbledModel(model, backend=backend)
    try:
        def run(**extra):
            gen = pm.generation(options, PebblingOptions.from_options(extra), PROMPT_LEN)
            return list(gen.tokens(prompt()))
        expected = run()
        for strategy in ("none", "minimal"):
            for cache in (0, 2, 8):
                assert run(pebbling_strategy=strategy, pebbling_expert_cache=cache) == expected, (strategy, cache)
    finally:
        pm.close()


def test_the_estimate_counts_the_caches_each_layer_keeps():
    """The memory model's KV bytes are those the caches take when made: each layer's own head shape and window,
    none for a layer reading another's (the estimate and the report print this figure)."""
    model = load_model(path_of("e2b"), progress=False)
    pm = PebbledModel(model, backend="stub")
    try:
        for n_ctx in (4, 32):  # within the window of 5, and past it
            memory = pm.memory_model(Options(num_ctx=n_ctx, kv_type="f16"))
            assert memory.kv_cache_bytes(n_ctx) == KVCache.allocate(model.config, n_ctx, kv="f16").nbytes
    finally:
        pm.close()


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_block_kv_types_give_the_tokens_of_full_residency(kv_type, backend):
    """Quantized caches (the shared ones read by later layers too), streamed: the tokens of every layer resident
    with the same cache type."""
    model = load_model(path_of("e2b"), progress=False)
    options = Options(temperature=0, num_predict=8, num_ctx=32, num_batch=4, kv_type=kv_type)
    pm = PebbledModel(model, backend=backend)
    try:
        run = lambda strategy: list(pm.generation(  # noqa: E731
            options, PebblingOptions.from_options({"pebbling_strategy": strategy}), PROMPT_LEN).tokens(prompt()))
        reference = run("none")
        for strategy in ("minimal", "every:3"):
            assert run(strategy) == reference, strategy
    finally:
        pm.close()

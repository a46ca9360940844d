"""KV cache types: f16 by default on every backend, chosen per server and per request, and the greedy tokens
they give against float32 caches."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from helpers import store_backend_params, tiny_model
from pyplugin.errors import InvalidArgumentError, OptionsError
from pyplugin.kv_types import KV_TYPES, decode, encode
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.layout import kv_ids
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.store import backend_named

NEAR_TIE = 1e-2  # a top-two gap within this share of the largest logit: either token is right
PROMPT = [5, 17, 42, 8, 99, 3, 61]


# ---------------------------------------------------------------------------------------------------
# choosing the type


def test_the_default_is_f16_and_the_server_may_choose_another(monkeypatch):
    monkeypatch.delenv("PEBBLING_KV_CACHE_TYPE", raising=False)
    monkeypatch.delenv("OLLAMA_KV_CACHE_TYPE", raising=False)
    assert Options().kv_type == "f16"
    monkeypatch.setenv("OLLAMA_KV_CACHE_TYPE", "q8_0")
    assert Options.from_dict({}).kv_type == "q8_0"
    monkeypatch.setenv("PEBBLING_KV_CACHE_TYPE", "Q4_0")  # pebbling's own variable first, in any case
    assert Options.from_dict({}).kv_type == "q4_0"
    assert Options.from_dict({"pebbling_kv_type": "f16"}).kv_type == "f16"  # the request's over the server's


@pytest.mark.parametrize("value", ["q5_0", "", 8, "f16 "])
def test_an_unknown_kv_type_is_refused_naming_the_accepted_ones(value):
    with pytest.raises(OptionsError, match="pebbling_kv_type.*accepted: f16, q8_0, q4_0, f32"):
        Options.from_dict({"pebbling_kv_type": value})


def test_a_bad_server_kv_type_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("PEBBLING_KV_CACHE_TYPE", "q3")
    with pytest.raises(OptionsError, match="PEBBLING_KV_CACHE_TYPE.*'q3'"):
        Options.from_dict({})


# ---------------------------------------------------------------------------------------------------
# the blocks


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_blocks_are_llama_cpps_byte_for_byte(name):
    x = np.random.default_rng(3).standard_normal((6, 2, 64)).astype(np.float32) * 3
    x[0, 0, :32] = 0  # an all-zero block: scale 0, no division by it
    t = KV_TYPES[name]
    ours = encode(x, t)
    assert ours.shape == (6, 2, 64 // 32 * t.block_bytes) and ours.dtype == np.uint8
    theirs = quants.quantize(x.reshape(12, 64), GGMLQuantizationType[name.upper()])
    np.testing.assert_array_equal(ours.reshape(12, -1), theirs)
    np.testing.assert_array_equal(decode(ours, t).reshape(12, 64),
                                  quants.dequantize(theirs, GGMLQuantizationType[name.upper()]))


# ---------------------------------------------------------------------------------------------------
# f16 caches against float32 ones


def greedy(pebbled, kv_type):
    """Greedy tokens with caches of kv_type, and each step's top-two gap over the largest logit."""
    options = Options(temperature=0, num_predict=12, num_ctx=48, num_batch=4, kv_type=kv_type)
    gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "every:2"}), len(PROMPT))
    gen.start(PROMPT)
    tokens, gaps = [], []
    while True:
        top = np.sort(gen.logits)[-2:]
        token = gen.next_token()
        if token is None or len(tokens) == options.num_predict:
            return tokens, gaps
        tokens.append(token)
        gaps.append((top[1] - top[0]) / np.abs(gen.logits).max())
        gen.logits = gen.decode_one(token)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", dict(weight_type="Q8_0")),
                                            ("gemma2", dict(sliding_window=8, attn_softcap=0.5))])
@pytest.mark.parametrize("backend", store_backend_params())
def test_f16_caches_give_the_float32_caches_tokens_up_to_a_near_tie(backend, arch, overrides):
    """fp16 rounds each K and V value by at most 2^-11 of itself, which moves logits by far less than the
    near-tie margin (1% of the largest logit): tokens agree up to the first step whose top two were that
    close under float32 caches, where either token is right. Prefill chunks of 4 and a decode step per
    token, through resident and streamed layers (every:2)."""
    model = tiny_model(arch, weights="quantized" if "weight_type" in overrides else "f16", n_layer=4, **overrides)
    pebbled = PebbledModel(model, backend=backend)
    try:
        f32_tokens, gaps = greedy(pebbled, "f32")
        f16_tokens, _ = greedy(pebbled, "f16")
        assert pebbled.store.entry_info(0, kv_ids(0)[0]).ggml_type == 1  # the last request's: F16
    finally:
        pebbled.close()
    assert len(f32_tokens) == len(f16_tokens) == 12
    for j, (a, b) in enumerate(zip(f16_tokens, f32_tokens)):
        if a != b:
            assert gaps[j] <= NEAR_TIE, (j, f16_tokens, f32_tokens)
            break


# ---------------------------------------------------------------------------------------------------
# attention from the stored blocks


@pytest.mark.parametrize("hd", [64, 96])  # two blocks a head (one register pass of V), and three (a pass and a half)
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("backend", store_backend_params())
def test_attention_reads_the_blocks_as_they_decode_and_stores_new_rows_as_they_encode(backend, name, hd):
    """pebble_attend over caches of each type equals attention over the values the blocks decode to (float64
    reference, float32 rounding apart), with the new row encoded into the caches byte for byte as
    kv_types.encode (llama.cpp's) encodes it."""
    kernels = backend_named(backend).kernels
    xp, t = kernels.xp, KV_TYPES[name]
    rng = np.random.default_rng(7)
    n_rows, n_head, n_kv = 48, 4, 2
    n_pos = [48, 9]
    q = rng.standard_normal((2, n_head, hd)).astype(np.float32)
    floats = [[rng.standard_normal((n_rows, n_kv, hd)).astype(np.float32) for _ in range(2)] for _ in n_pos]
    new = [rng.standard_normal((2, n_kv, hd)).astype(np.float32) for _ in range(2)]   # k, v of each sequence
    caches = [tuple(xp.asarray(encode(c, t)) for c in pair) for pair in floats]
    got = to_host(kernels.attend(xp.asarray(q), caches, n_pos, n_kv, 0.125, 0.0,
                                 new=(xp.asarray(new[0]), xp.asarray(new[1]))))
    group = n_head // n_kv
    for b, n in enumerate(n_pos):
        k_bytes, v_bytes = (to_host(c) for c in caches[b])
        for c, rows in ((k_bytes, new[0]), (v_bytes, new[1])):
            np.testing.assert_array_equal(c[n - 1], encode(rows[b], t))    # the new row, encoded
        keys, values = (decode(c[:n], t).astype(np.float64) for c in (k_bytes, v_bytes))
        for h in range(n_head):
            s = keys[:, h // group] @ (q[b, h] * np.float32(0.125)).astype(np.float64)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[b, h * hd:(h + 1) * hd], (p / p.sum()) @ values[:, h // group],
                                       rtol=1e-5, atol=1e-5)


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("backend", store_backend_params())
def test_block_caches_need_a_head_dim_of_whole_blocks(backend, name):
    kernels = backend_named(backend).kernels
    xp, t = kernels.xp, KV_TYPES[name]
    cache = xp.zeros((8, 2, 48 // 32 * t.block_bytes), np.uint8)  # 48 values: a block and a half
    with pytest.raises(InvalidArgumentError):
        kernels.lib.attend(xp.zeros((1, 4 * 48), np.float32), t.ggml_type, [cache], [cache], [3], 8, 4, 2, 48, 1.0,
                           0.0, xp.zeros((1, 4 * 48), np.float32), xp.zeros(1 << 12, np.uint8))


# ---------------------------------------------------------------------------------------------------
# 8-bit and 4-bit caches through a whole generation

BLOCK_CASES = {  # head_dim a multiple of 32; GQA, Q/K norms, a sliding window's ring
    "llama": ("llama", dict(n_embd=128, n_head=4, n_head_kv=2)),
    "qwen3": ("qwen3", dict(key_length=32)),
    "gemma3": ("gemma3", dict(key_length=32, sliding_window=8)),
    "gpt-oss": ("gpt-oss", dict(key_length=32, sliding_window=8, n_expert=4, n_expert_used=2, n_ff_exp=32)),
}


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
@pytest.mark.parametrize("backend", [b for b in store_backend_params() if "stub" not in str(b)])
def test_block_caches_give_the_python_forward_pass_tokens(backend, case, name):
    """The native decode step over q8_0/q4_0 caches gives the tokens of the stub backend (the Python forward
    pass, which encodes and decodes the blocks in numpy), up to a near-tie; and the entries hold that type, at
    its size. Dense weights, which every backend multiplies by float32 vectors as they are: with quantized
    ones the host library rounds activations, which moves a K value across a 4-bit step now and then, and a
    step of q4_0 is an eighth of its block's largest value, noise far above the float32 rounding here."""
    arch, overrides = BLOCK_CASES[case]
    model = tiny_model(arch, weights="f16", n_layer=4, **overrides)
    results = {}
    for which in ("stub", backend):
        pebbled = PebbledModel(model, backend=which)
        try:
            results[which] = greedy(pebbled, name)
            cfg, t = model.config, KV_TYPES[name]
            for i in range(cfg.n_layer):
                info = pebbled.store.entry_info(i, kv_ids(0)[1])
                assert info.ggml_type == t.ggml_type
                assert info.nbytes == cfg.kv_rows(i, 48) * cfg.n_head_kv * cfg.head_dim // 32 * t.block_bytes
        finally:
            pebbled.close()
    (tokens, gaps), (got, _) = results["stub"], results[backend]
    assert len(got) == len(tokens) == 12
    for j, (a, b) in enumerate(zip(got, tokens)):
        if a != b:
            assert gaps[j] <= NEAR_TIE, (j, got, tokens)
            break


# ---------------------------------------------------------------------------------------------------
# bytes: accounted by the store, estimated by the plan and `pebbling estimate`


@pytest.mark.parametrize("backend", store_backend_params())
def test_accounted_kv_bytes_equal_the_estimate_for_every_type(backend):
    """The store's KV entries of a request hold exactly n_layer x positions (a sliding layer's window) x
    n_head_kv x head_dim x the type's bytes a value, K and V; the plan's memory model says the same."""
    model = tiny_model("gemma3", n_layer=4, key_length=32, sliding_window=8)
    cfg, n_ctx = model.config, 256
    pebbled = PebbledModel(model, backend=backend)
    try:
        for name in ("f16", "q8_0", "q4_0"):
            options = Options(temperature=0, num_predict=2, num_ctx=n_ctx, kv_type=name)
            pebbling = PebblingOptions.from_options({"pebbling_strategy": "none"})
            memory = pebbled.plan(options, pebbling).memory
            gen = pebbled.generation(options, pebbling, len(PROMPT))
            list(gen.tokens(PROMPT))
            accounted = sum(pebbled.store.entry_info(i, tid).nbytes for i in range(cfg.n_layer) for tid in kv_ids(0))
            t = KV_TYPES[name]
            positions = sum(min(n_ctx, cfg.sliding_window) if cfg.is_sliding(i) else n_ctx for i in range(cfg.n_layer))
            formula = 2 * positions * cfg.n_head_kv * cfg.head_dim * t.block_bytes // t.block
            estimated = sum(memory.kv_rows(i, n_ctx) for i in range(cfg.n_layer)) * memory.kv_bytes_per_token
            assert accounted == estimated == formula, name
            report = gen.report()
            assert report["kv_type"] == name and report["kv_cache_bytes"] == accounted  # the response says so
            for i in range(cfg.n_layer):  # a layer's placement: each cache at a multiple of 256 bytes, no more
                entry = pebbled.store.entry_info(i, kv_ids(0)[0]).nbytes
                assert 2 * entry <= memory.kv_bytes(i) < 2 * (entry + 256)
    finally:
        pebbled.close()


def test_estimate_shows_every_kv_type(capsys):
    import json

    from helpers import tiny_path
    from pyplugin.cli import main
    path = str(tiny_path("llama", n_embd=128, n_head=4, n_head_kv=2))
    assert main(["estimate", path, "--num-ctx", "256", "--backend", "stub", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    kv = r["kv_cache_bytes_by_type"]
    assert r["kv_type"] == "f16" and kv["f16"] == r["kv_cache_bytes"]
    assert kv["f16"] / kv["q8_0"] == pytest.approx(64 / 34) and kv["f16"] / kv["q4_0"] == pytest.approx(64 / 18)
    # the ratio shown is the bytes' own: 1.88x, not the 2x of 8 bits for 16, as each block carries its fp16 scale
    assert r["kv_cache_f16_over_type"] == pytest.approx({"f16": 1.0, "q8_0": 64 / 34, "q4_0": 64 / 18})
    for s in r["strategies"].values():  # a smaller cache, a smaller peak, by exactly the KV bytes saved
        peaks = s["estimated_peak_bytes_by_kv_type"]
        if s["resident_layers"] == s["n_layers"]:
            assert peaks["f16"] - peaks["q8_0"] == kv["f16"] - kv["q8_0"]
        assert peaks["f16"] > peaks["q8_0"] > peaks["q4_0"]
    assert main(["estimate", path, "--num-ctx", "256", "--backend", "stub", "--kv-type", "q4_0"]) == 0
    text = capsys.readouterr().out
    assert "in q4_0 (estimate; f16" in text and "peak, KV q8_0" in text
    assert "(1.88x less than f16)" in text and "(3.56x less than f16)" in text
    assert "q8_0 34 bytes per 32 values where f16 takes 64" in text


def test_the_portable_kernels_attend_from_blocks_too():
    """What a CPU without AVX2 runs (PEBBLING_SIMD=portable): the attention tests above, in a process of
    their own with the setting."""
    import os
    import subprocess
    import sys

    from pyplugin.store import probe
    if not probe("host").usable:
        pytest.skip("the host library is not built here (make host)")
    env = {**os.environ, "PEBBLING_SIMD": "portable", "PEBBLING_TEST_BACKENDS": "host"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "host and attention_reads_the_blocks"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_plan_that_does_not_fit_says_which_kv_type_would():
    model = tiny_model("llama", n_layer=4, n_embd=128, n_head=4, n_head_kv=2)
    pebbled = PebbledModel(model, backend="stub")
    try:
        none = PebblingOptions.from_options({"pebbling_strategy": "none"})
        peaks = {t: pebbled.plan(Options(num_ctx=4096, kv_type=t), none).estimated_peak_bytes
                 for t in ("f16", "q8_0", "q4_0")}
        assert peaks["f16"] > peaks["q8_0"] > peaks["q4_0"]
        for limit, named in (((peaks["f16"] + peaks["q8_0"]) // 2, "'q8_0'"),
                             ((peaks["q8_0"] + peaks["q4_0"]) // 2, "'q4_0'")):
            pebbling = PebblingOptions.from_options({"pebbling_strategy": "none", "pebbling_memory_limit": limit})
            with pytest.raises(OptionsError, match=f"with pebbling_kv_type {named} it fits"):
                pebbled.plan(Options(num_ctx=4096), pebbling)
        pebbling = PebblingOptions.from_options({"pebbling_strategy": "none",
                                                 "pebbling_memory_limit": peaks["q4_0"] - 1})
        with pytest.raises(OptionsError) as refused:  # nothing fits: no type is named
            pebbled.plan(Options(num_ctx=4096), pebbling)
        assert "pebbling_kv_type" not in str(refused.value)
    finally:
        pebbled.close()


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_a_sliding_layer_s_first_prefill_reads_no_rows_of_a_block_cache(name):
    """The model's own forward pass (as agreement_llamacpp runs it) over a sliding window's ring, from position 0:
    the ring's old rows are none, decoded as an empty array (once a reshape of zero rows that failed)."""
    from pyplugin.runtime.generation import Generation

    model = tiny_model("gemma3", weights="f16", n_layer=2, key_length=32, sliding_window=8)
    tokens = list(range(3, 15))
    exact = Generation(model, Options(temperature=0, num_ctx=32, kv_type="f32")).prefill(tokens)
    blocks = Generation(model, Options(temperature=0, num_ctx=32, kv_type=name)).prefill(tokens)
    assert np.isfinite(blocks).all()
    assert np.linalg.norm(blocks - exact) / np.linalg.norm(exact) < (0.02 if name == "q8_0" else 0.1)
    assert decode(np.zeros((0, 2, 34), np.uint8), KV_TYPES["q8_0"]).shape == (0, 2, 32)

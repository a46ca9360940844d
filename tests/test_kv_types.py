"""KV cache types: f16 by default on every backend, chosen per server and per request, and the greedy tokens
they give against float32 caches."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from helpers import store_backend_params, tiny_model
from pyplugin.errors import OptionsError
from pyplugin.kv_types import KV_TYPES, decode, encode
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.layout import kv_ids
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions

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

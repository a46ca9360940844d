"""Context shift: a generation that fills num_ctx keeps num_keep positions, drops half of the rest and goes
on, its kept keys rotated to their new positions, for every architecture and KV type."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import store_backend_params, tiny_model
from pyplugin.kv_types import KV_TYPES, decode, encode
from pyplugin.model.kv_shift import rotate, shift_amount, shift_caches, shift_due, shiftable
from pyplugin.model.transformer import apply_rope, rope_table
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions

NEAR_TIE = 1e-2
PROMPT = [5, 17, 42, 8, 99, 3, 61]


def test_the_amounts_and_the_moment_are_llama_cpp_servers():
    """llama.cpp's server (which Ollama runs) shifts once the next token would fill the context, keeps n_keep
    (its caller adds the BOS; at most n_ctx - 4) and drops half of the rest; its log of a 512 context with
    n_keep 1 reads n_past = 511, n_discard = 255."""
    assert not shift_due(510, 512) and shift_due(511, 512)
    assert shift_amount(511, 1, 512) == (1, 255)
    assert shift_amount(23, 5, 24) == (5, 9) and shift_amount(23, 4, 24) == (4, 9)
    assert shift_amount(31, 100, 32) == (28, 1)  # num_keep past the context: n_ctx - 4 kept
    assert shift_amount(3, 100, 6) == (2, 0)     # ... and never every position held: nothing to drop
    assert shiftable(64, 64, 4, 30) and shiftable(8, 64, 4, 30) and not shiftable(40, 64, 4, 30)


@pytest.mark.parametrize("name", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("arch, extra", [("llama", {}), ("phi3", {}),  # GGML's normal pairs, and NeoX's halves
                                         ("llama", {"rope_yarn": (8.0, 16)})])  # YaRN: its magnitude applied once
def test_a_moved_key_is_the_key_rotated_for_its_new_position(arch, extra, name):
    """R(-d) R(p) k = R(p - d) k: each kept key, once shifted, is what rotating its unrotated key for its new
    position gives, within the cache type's own rounding (float32's, or one more rounding to the type). With
    YaRN, whose tables scale cos and sin by 1 + 0.1 ln(factor), the shift rotates without scaling again."""
    cfg = tiny_model(arch, n_embd=128, n_head=4, n_head_kv=2, **extra).config
    t, n_past, keep, drop = KV_TYPES[name], 24, 4, 10
    raw = np.random.default_rng(2).standard_normal((n_past, cfg.n_head_kv, cfg.head_dim)).astype(np.float32)
    cos, sin = rope_table(cfg, n_past, np, np.float32)
    k = encode(apply_rope(cfg, raw, cos, sin), t)                         # each row rotated for its position
    v = encode(raw, t)
    v_before = v.copy()
    shift_caches(cfg, k, v, keep, drop, n_past)
    new = np.r_[np.arange(keep), np.arange(keep + drop, n_past) - drop]  # where each kept position now is
    old = np.r_[np.arange(keep), np.arange(keep + drop, n_past)]
    want = apply_rope(cfg, raw[old], cos[new], sin[new])
    # q8_0's step is 1/127 of its block's largest value, q4_0's 1/8: one rounding more than the cache's own
    tolerance = {"f32": 1e-5, "f16": 2e-3, "q8_0": 2e-2, "q4_0": 0.15}[name]
    np.testing.assert_allclose(decode(k[:len(new)], t), want, atol=tolerance * np.abs(want).max())
    np.testing.assert_array_equal(v[:len(new)], v_before[old])           # values move as they are
    assert np.abs(decode(rotate(cfg, k[:1], 0), t) - decode(k[:1], t)).max() <= tolerance


def test_a_ring_rolls_each_position_onto_its_new_row():
    cfg = tiny_model("gemma3", key_length=32, sliding_window=8).config.for_layer(0)
    rows, n_past, keep, drop = 8, 32, 4, 14
    positions = np.arange(n_past - rows, n_past)
    v = np.zeros((rows, cfg.n_head_kv, cfg.head_dim), np.float32)
    v[positions % rows] = positions[:, None, None]                        # each row holds its position
    k = v.copy()
    shift_caches(cfg, k, v, keep, drop, n_past)
    assert (v[(positions - drop) % rows, 0, 0] == positions).all()
    with pytest.raises(ValueError, match="cannot shift"):
        shift_caches(cfg, k, v, keep, drop, 20)  # its window after the shift would reach the kept positions


def generate(pebbled, kv_type, n_ctx=24, n=30):
    options = Options(temperature=0, num_predict=n, num_ctx=n_ctx, num_batch=4, num_keep=4, kv_type=kv_type)
    gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "every:2"}), len(PROMPT))
    gen.start(PROMPT)
    tokens, gaps = [], []
    while True:
        top = np.sort(gen.logits)[-2:]
        token = gen.next_token()
        if token is None:
            break
        tokens.append(token)
        gaps.append((top[1] - top[0]) / np.abs(gen.logits).max())
        if not gen.wants_forward():
            break
        gen.logits = gen.decode_one(token)
    return tokens, gaps, gen


def llama_cpp_server_shifts(model, n_prompt, n_forwarded, n_ctx, num_keep):
    """The (kept, dropped) of each shift llama.cpp's server makes as n_forwarded tokens follow a prompt of
    n_prompt (its update_slots, written out again): n_keep = num_keep + the BOS the model adds, at most
    n_ctx - 4; a shift whenever n_past + 1 >= n_ctx before a token goes in; half of the rest dropped."""
    n_keep = min(num_keep + int(model.tokenizer.add_bos), n_ctx - 4)
    shifts, n_past = [], n_prompt
    for _ in range(n_forwarded):
        if n_past + 1 >= n_ctx:
            shifts.append((n_keep, (n_past - n_keep) // 2))
            n_past -= shifts[-1][1]
        n_past += 1
    return shifts, n_past


# Heads of 32: whole q8_0 blocks for every case.
CASES = {"llama": ("llama", dict(n_embd=128, n_head=4, n_head_kv=2)), "qwen2": ("qwen2", dict(key_length=32)),
         "phi3": ("phi3", dict(key_length=32)), "gemma3-ring": ("gemma3", dict(key_length=32, sliding_window=6)),
         "gemma2": ("gemma2", dict(key_length=32, sliding_window=6, attn_softcap=0.5)),
         # sinks, experts, every other layer a ring of 6, YaRN: rotated keys carry YaRN's blend (seed 1: its 30
         # greedy tokens hold no end-of-generation token, which would end the generation before its shifts)
         "gpt-oss": ("gpt-oss", dict(key_length=32, sliding_window=6, n_expert=4, n_expert_used=2, n_ff_exp=32,
                                     rope_yarn=(8.0, 16), seed=1))}


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", [b for b in store_backend_params() if "stub" not in str(b)])
def test_a_generation_past_num_ctx_goes_on_after_a_shift(backend, case, kv_type):
    """30 tokens from a 7-token prompt in a context of 24: shifted (twice) as llama.cpp's server shifts,
    reported, and the native decode step's tokens are the Python forward pass's (the stub's) up to a
    near-tie."""
    arch, overrides = CASES[case]
    model = tiny_model(arch, n_layer=4, **overrides)
    want_shifts, want_pos = llama_cpp_server_shifts(model, len(PROMPT), 29, 24, 4)  # the last token not forwarded
    assert len(want_shifts) == 2
    results = {}
    for which in ("stub", backend):
        pebbled = PebbledModel(model, backend=which)
        try:
            tokens, gaps, gen = generate(pebbled, kv_type)
            report = gen.report()
            assert len(tokens) == 30 and gen.stats.done_reason == "length"
            assert gen.shifts == want_shifts and gen.pos == want_pos
            assert report["context_shifts"] == gen.stats.context_shifts == 2
            held = gen.forwarded()
            assert len(held) == gen.pos and held[:4] == PROMPT[:4]  # num_keep's tokens stay first
            results[which] = tokens, gaps
        finally:
            pebbled.close()
    (want, gaps), (got, _) = results["stub"], results[backend]
    for j, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[j] <= NEAR_TIE, (j, got, want)
            break


def test_resident_layers_shift_as_the_store_does():
    """The LayerSource without a store (ResidentLayers, the reference loop) shifts its own caches: the same
    tokens as through the stub's store, exactly (both are the Python forward pass on the stub's kernels)."""
    from pyplugin.runtime.generation import Generation, ResidentLayers
    from pyplugin.store import backend_named
    model = tiny_model("qwen2", n_layer=3)
    options = Options(temperature=0, num_predict=30, num_ctx=24, num_batch=4, num_keep=4)
    gen = Generation(model, options, layers=ResidentLayers(model, 24, backend_named("stub").kernels, "f16"))
    tokens = list(gen.tokens(PROMPT))
    assert gen.stats.context_shifts == 2 and len(tokens) == 30
    pebbled = PebbledModel(model, backend="stub")
    try:
        stored = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "minimal"}),
                                    len(PROMPT))
        assert list(stored.tokens(PROMPT)) == tokens
    finally:
        pebbled.close()


def resident_generation(model, **options):
    """A greedy generation whose end-of-generation tokens are masked, so that only its limits end it."""
    from pyplugin.runtime.generation import Generation, ResidentLayers
    from pyplugin.store import backend_named
    options = Options(temperature=0, num_batch=4, num_keep=4, **options)
    gen = Generation(model, options, layers=ResidentLayers(model, options.num_ctx, backend_named("stub").kernels))
    ends, sample = list(model.tokenizer.eog_ids), gen.sample
    gen.sample = lambda logits, history: sample(np.where(np.isin(np.arange(logits.size), ends), -np.inf, logits),
                                                history)
    return gen


def test_num_predict_is_bounded_as_ollama_bounds_it():
    """Ollama sends llama.cpp num_predict -1 (and any negative, or more than that) as 10 x num_ctx
    (llm.boundedNumPredict), so that a generation that shifts cannot run forever; -2 fills the context."""
    assert Options(num_predict=-1, num_ctx=8).predict_limit == 80
    assert Options(num_predict=1000, num_ctx=8).predict_limit == 80
    assert Options(num_predict=5, num_ctx=8).predict_limit == 5
    assert Options(num_predict=-2, num_ctx=8).predict_limit is None
    assert Options().shifts and not Options(num_predict=-2).shifts and not Options(shift=False).shifts


@pytest.mark.parametrize("num_predict", [-1, 1000])
def test_an_open_ended_generation_shifts_on_to_ollamas_bound(num_predict):
    """num_predict -1, Ollama's default ("until the end of generation"), goes past num_ctx by shifting, as
    Ollama's does, and ends ("length") at 10 x num_ctx tokens; so does a num_predict past that bound."""
    gen = resident_generation(tiny_model("qwen2", n_layer=2), num_predict=num_predict, num_ctx=16)
    tokens = list(gen.tokens(PROMPT))
    assert len(tokens) == 160 and gen.stats.done_reason == "length"
    assert gen.stats.context_shifts == len(gen.shifts) > 10 and gen.pos < 16


@pytest.mark.parametrize("options", [dict(num_predict=-2), dict(num_predict=-1, shift=False),
                                     dict(num_predict=100, shift=False)])
def test_without_a_shift_a_generation_ends_with_its_context(options):
    """num_predict -2 ("fill the context") and a request's shift false stop when the context is full:
    every position used, the last token sampled but not forwarded."""
    gen = resident_generation(tiny_model("qwen2", n_layer=2), num_ctx=16, **options)
    tokens = list(gen.tokens(PROMPT))
    assert len(tokens) == 16 - len(PROMPT) + 1 and gen.stats.done_reason == "length"
    assert gen.stats.context_shifts == 0 and gen.pos == 16

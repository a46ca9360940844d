"""The generation loop, sampling and options."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import tiny_model
from pyplugin.errors import OptionsError
from pyplugin.runtime import Generation, generate
from pyplugin.runtime.options import Options
from pyplugin.runtime.sampling import Sampler, apply_repeat_penalty

PROMPT_TEXT = "Hello world! The quick brown fox"


def prompt(model):
    return model.tokenizer.encode(PROMPT_TEXT)


def run(model, **options):
    return list(generate(model, prompt(model), Options(num_ctx=128, **options)))


def scripted(monkeypatch, ids):
    """Make Generation.sample return ``ids`` in turn (to drive the loop to a chosen text)."""
    it = iter(ids)
    monkeypatch.setattr(Generation, "sample", lambda self, logits, history: next(it))


# ---------------------------------------------------------------------------------------------------
# generation


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_greedy_generation_is_deterministic(arch):
    model = tiny_model(arch)
    first = run(model, temperature=0, num_predict=12, seed=1)
    assert first == run(model, temperature=0, num_predict=12, seed=2)
    assert len(first) == 12 or first[-1] not in model.tokenizer.eog_ids


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model = tiny_model("llama")
    same = dict(temperature=1.5, top_k=0, top_p=1.0, num_predict=24)
    a, b = run(model, seed=7, **same), run(model, seed=7, **same)
    c = run(model, seed=8, **same)
    assert a == b and len(a) > 0
    assert a != c


def test_num_predict_limits_the_tokens(monkeypatch):
    model = tiny_model("llama")
    gen = Generation(model, Options(temperature=0, num_predict=5, num_ctx=64))
    assert len(list(gen.tokens(prompt(model)))) <= 5
    zero = Generation(model, Options(num_predict=0, num_ctx=64))
    assert list(zero.tokens(prompt(model))) == [] and zero.stats.done_reason == "length"


def test_end_of_generation_token_stops_and_is_not_returned(monkeypatch):
    model = tiny_model("llama")
    eot = model.tokenizer.tokens.index("<|eot_id|>")
    scripted(monkeypatch, [10, 11, eot, 12])
    gen = Generation(model, Options(num_ctx=64))
    assert list(gen.tokens(prompt(model))) == [10, 11]
    assert gen.stats.done_reason == "stop" and gen.stats.generated_tokens == 2
    assert gen.stats.prompt_tokens == len(prompt(model))


@pytest.mark.parametrize("no_shift", [dict(num_predict=-2), dict(shift=False)])
def test_full_context_ends_with_length_where_it_may_not_shift(monkeypatch, no_shift):
    model = tiny_model("llama")
    p = prompt(model)
    scripted(monkeypatch, [10] * 100)
    gen = Generation(model, Options(num_ctx=len(p) + 3, **no_shift))
    # 3 tokens fill the cache; the last one's logits give a 4th that no position is left for
    assert len(list(gen.tokens(p))) == 4
    assert gen.pos == len(p) + 3 and gen.stats.done_reason == "length"


def test_stop_string_cuts_the_text_even_across_tokens(monkeypatch):
    model = tiny_model("llama")
    tok = model.tokenizer
    ids = tok.encode("one two STOP three", add_bos=False)
    assert len(ids) > 3
    scripted(monkeypatch, ids + [0] * 10)
    gen = Generation(model, Options(num_ctx=128, stop=("STOP", "never")))
    assert "".join(gen.text(prompt(model))) == "one two "
    assert gen.stats.done_reason == "stop"


def test_text_without_stop_strings_is_the_decoded_tokens(monkeypatch):
    model = tiny_model("llama")
    ids = model.tokenizer.encode("héllo 日本語 🙂", add_bos=False)
    scripted(monkeypatch, ids + [model.tokenizer.eos_id])
    gen = Generation(model, Options(num_ctx=128))
    pieces = list(gen.text(prompt(model)))
    assert "".join(pieces) == "héllo 日本語 🙂" and all("\ufffd" not in p for p in pieces)


def test_prompt_longer_than_num_ctx_is_refused():
    model = tiny_model("llama")
    with pytest.raises(OptionsError, match="more than num_ctx"):
        list(generate(model, list(range(40)), Options(num_ctx=16)))


def test_empty_prompt_is_refused():
    with pytest.raises(OptionsError, match="empty"):
        list(generate(tiny_model("llama"), [], Options(num_ctx=16)))


def test_stats_are_counted():
    model = tiny_model("llama")
    gen = Generation(model, Options(temperature=0, num_predict=4, num_ctx=64))
    out = list(gen.tokens(prompt(model)))
    assert gen.stats.generated_tokens == len(out)
    assert gen.stats.prompt_ns > 0 and gen.stats.generate_ns > 0


# ---------------------------------------------------------------------------------------------------
# sampling


LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0], dtype=np.float32)


def test_temperature_zero_is_argmax():
    assert Sampler(Options(temperature=0, repeat_penalty=1.0))(LOGITS) == 1


@pytest.mark.parametrize("option", [dict(top_k=1), dict(top_p=0.01), dict(min_p=1.0)])
def test_truncation_to_one_candidate_is_argmax(option):
    sampler = Sampler(Options(temperature=5.0, seed=0, repeat_penalty=1.0, **option))
    assert {sampler(LOGITS) for _ in range(50)} == {1}


def test_top_k_keeps_the_k_best():
    sampler = Sampler(Options(temperature=10.0, top_k=2, top_p=1.0, seed=0, repeat_penalty=1.0))
    assert {sampler(LOGITS) for _ in range(200)} == {1, 2}


def test_min_p_drops_unlikely_tokens():
    sampler = Sampler(Options(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3, seed=0, repeat_penalty=1.0))
    # p relative to the best: e^(2-3)=0.37 stays, e^(1-3)=0.14 goes
    assert {sampler(LOGITS) for _ in range(300)} == {1, 2}


def test_sampling_follows_the_softmax():
    sampler = Sampler(Options(temperature=1.0, top_k=0, top_p=1.0, seed=3, repeat_penalty=1.0))
    draws = np.bincount([sampler(LOGITS) for _ in range(4000)], minlength=5) / 4000
    expected = np.exp(LOGITS - LOGITS.max()) / np.exp(LOGITS - LOGITS.max()).sum()
    np.testing.assert_allclose(draws, expected, atol=0.03)


def test_repeat_penalty_lowers_recent_tokens_only():
    out = apply_repeat_penalty(LOGITS, [1, 4, 1], 2.0)
    assert out.tolist() == [1.0, 1.5, 2.0, 0.5, -2.0]
    greedy = Sampler(Options(temperature=0, repeat_penalty=2.0, repeat_last_n=2))
    assert greedy(LOGITS, history=[1]) == 2
    assert greedy(LOGITS, history=[1, 3, 3]) == 1      # token 1 is outside the last 2


# ---------------------------------------------------------------------------------------------------
# options


def test_defaults_are_ollamas():
    o = Options()
    assert (o.temperature, o.top_k, o.top_p, o.min_p, o.repeat_penalty, o.repeat_last_n) == \
        (0.8, 40, 0.9, 0.0, 1.1, 64)
    assert (o.seed, o.num_predict, o.num_ctx, o.num_batch, o.stop) == (None, -1, 2048, 512, ())


def test_from_dict_parses_and_ignores_unknown_keys():
    o = Options.from_dict({"temperature": 0, "top_k": 40.0, "seed": -1, "stop": "###",
                           "num_gpu": 99, "pebbling_strategy": "sqrt"})
    assert (o.temperature, o.top_k, o.seed, o.stop) == (0.0, 40, None, ("###",))


@pytest.mark.parametrize("options,message", [
    ({"temperature": "hot"}, r"option 'temperature': got 'hot' \(str\); accepted: a number >= 0"),
    ({"temperature": -0.1}, "'temperature'.*a number >= 0"),
    ({"top_k": 4.5}, "'top_k': got 4.5 .*an integer >= 0"),
    ({"top_k": True}, "'top_k': got True \\(bool\\)"),
    ({"top_p": 1.5}, "'top_p'.*from 0 to 1"),
    ({"repeat_penalty": 0}, "'repeat_penalty'.*> 0"),
    ({"num_predict": -3}, "'num_predict': got -3 .*an integer >= -2"),
    ({"num_ctx": 0}, "'num_ctx': got 0 .*an integer >= 1"),
    ({"num_batch": "many"}, "'num_batch'"),
    ({"stop": [1, 2]}, "'stop'.*a string or a list of non-empty strings"),
    ({"seed": 1.5}, "'seed'"),
])
def test_invalid_options_name_the_option_the_value_and_what_is_accepted(options, message):
    with pytest.raises(OptionsError, match=message):
        Options.from_dict(options)


def test_num_ctx_is_clamped_to_the_training_context():
    # Ollama lowers a num_ctx past what the model was trained on rather than refusing the request.
    assert Options.from_dict({"num_ctx": 4096}, n_ctx_train=256).num_ctx == 256
    assert Options.from_dict({"num_ctx": 4096}, n_ctx_train=256, max_ctx=100).num_ctx == 100
    assert Options.from_dict({}, n_ctx_train=256).num_ctx == 256      # the default is lowered
    assert Options.from_dict({"num_ctx": 100}, n_ctx_train=256).num_ctx == 100


def test_options_must_be_an_object():
    with pytest.raises(OptionsError, match="must be an object"):
        Options.from_dict(["temperature", 0])

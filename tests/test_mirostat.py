"""Mirostat 1 and 2 (`mirostat`, `mirostat_tau`, `mirostat_eta`), as llama.cpp (and so Ollama) samples
with them: the surprise of the tokens drawn (-log2 p, in bits) tracks mirostat_tau, on spread synthetic
logits over thousands of steps and on a real model's text; the temperature comes first and 0 is greedy;
Mirostat replaces the penalties, top_k, top_p and min_p; each request keeps its own state.

How close is close: Mirostat moves its threshold mu by eta x (surprise - tau) after every token, so over N
tokens mean(surprise) - tau = (mu_0 - mu_N) / (eta N) exactly. The mean tracks tau when mu settles, and
is off by at most the distance mu travelled divided by eta N: the tolerances below are that distance,
bounded, and the tests also hold mu to it. A tau beyond what the distribution can give (Mirostat only
ever cuts the distribution, so it cannot add surprise) is where it stops tracking: mu then runs away."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import requests

import pyplugin
from helpers import tiny_path
from pyplugin.errors import OptionsError, PebblingError
from pyplugin.runtime import Options
from pyplugin.runtime.sampling import Sampler, mirostat_candidates, mirostat_k, softmax, zipf_exponent
from server_patch import create_app
from server_patch.local import serving

ROOT = Path(pyplugin.__file__).resolve().parents[1]


def run(version: int, tau: float, steps: int, *, vocab: int = 8192, spread: float = 3.0, seed: int = 0,
        temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray, Sampler]:
    """(the surprise Mirostat observed at each step, that of the same token under the whole softmax,
    the sampler) over `steps` draws from fresh normal logits: a wide, flat-topped distribution in which
    any tau up to about 10 bits can be reached."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(Options(mirostat=version, mirostat_tau=tau, temperature=temperature, seed=seed))
    observed, whole = [], []
    for _ in range(steps):
        logits = rng.normal(0.0, spread, vocab)
        token = sampler(logits)
        observed.append(sampler.surprise)
        whole.append(-math.log2(softmax(logits, temperature)[token]))
    return np.array(observed), np.array(whole), sampler


@pytest.mark.parametrize("version", [1, 2])
def test_the_observed_surprise_tracks_tau_over_thousands_of_steps(version):
    steps, eta = 2000, 0.1
    means = {}
    for tau in (3.0, 6.0):
        observed, whole, sampler = run(version, tau, steps)
        drift = 2 * tau - sampler.mu  # mu starts at 2 tau, as in llama.cpp
        assert observed.mean() - tau == pytest.approx(drift / (eta * steps), abs=1e-9)  # the identity above
        assert abs(drift) < 10  # mu settled: within 10 bits of where it started after 2000 steps
        assert abs(observed.mean() - tau) < 10 / (eta * steps)  # so the mean is within 0.05 bits of tau
        assert (whole >= observed - 1e-9).all()  # truncation only ever adds probability to what it keeps
        means[tau] = whole.mean()
    assert means[3.0] < means[6.0]  # and the text's own surprise follows tau


def test_a_tau_beyond_reach_lets_mu_run_away_and_the_surprise_stays_below():
    observed, _, sampler = run(2, 40.0, 300, spread=0.5)  # a vocabulary of 8192 holds at most 13 bits
    assert observed.mean() < 14 and sampler.mu > 2 * 40 + 0.1 * 300 * (40 - 14)


def test_mirostat_2_keeps_the_tokens_no_more_surprising_than_mu():
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625]))
    ids, probs = mirostat_candidates(logits, 2, mu=2.0)  # surprises 1, 2, 3, 4, 4 bits
    assert ids.tolist() == [0, 1] and probs.tolist() == pytest.approx([2 / 3, 1 / 3])
    ids, probs = mirostat_candidates(logits, 2, mu=0.5)  # none is that unsurprising: the most probable one
    assert ids.tolist() == [0] and probs.tolist() == [1.0]


def test_mirostat_1_estimates_zipfs_exponent_and_keeps_k_tokens_as_llama_cpp():
    n = 5000
    for s in (0.8, 1.0, 1.3):
        zipf = np.arange(1, n + 1, dtype=np.float64) ** -s
        assert zipf_exponent(zipf[:100] / zipf.sum()) == pytest.approx(s, rel=1e-9)
    eps, mu = 0.3, 6.0  # llama.cpp: k = (eps 2^mu / (1 - N^-eps))^(1 / s_hat)
    assert mirostat_k(1.3, mu, n) == int((eps * 2 ** mu / (1 - n ** -eps)) ** (1 / 1.3))
    assert mirostat_k(1.0, mu, n) == int(2 ** mu / math.log(n))  # its limit at s_hat 1
    assert mirostat_k(1.3, 500.0, n) == n and mirostat_k(1.3, -50.0, n) == 1
    logits = np.log(np.arange(1, n + 1, dtype=np.float64) ** -1.3)
    ids, probs = mirostat_candidates(logits, 1, mu)
    assert ids.tolist() == list(range(mirostat_k(1.3, mu, n))) and probs.sum() == pytest.approx(1.0)


def test_masked_tokens_are_never_drawn():
    logits = np.random.default_rng(1).normal(0, 2, 1000)
    logits[::2] = -np.inf  # a grammar's mask
    for version in (1, 2):
        sampler = Sampler(Options(mirostat=version, mirostat_tau=9.0, temperature=1.0, seed=3))
        assert all(sampler(logits) % 2 == 1 for _ in range(200))


def test_temperature_comes_first_and_zero_is_greedy():
    logits = np.random.default_rng(2).normal(0, 1, 500)
    greedy = Sampler(Options(mirostat=2, mirostat_tau=8.0, temperature=0.0))
    assert {greedy(logits) for _ in range(20)} == {int(np.argmax(logits))}
    hot = [run(2, 4.0, 400, temperature=t, spread=1.0)[0].mean() for t in (0.5, 1.0)]
    assert hot[0] == pytest.approx(4.0, abs=0.5) and hot[1] == pytest.approx(4.0, abs=0.5)


def test_mirostat_replaces_the_penalties_top_k_top_p_and_min_p():
    logits = np.random.default_rng(4).normal(0, 2, 2000)
    history = [int(np.argmax(logits))] * 64
    sampler = Sampler(Options(mirostat=2, mirostat_tau=6.0, temperature=1.0, seed=5, top_k=1, top_p=0.01,
                              min_p=0.99, repeat_penalty=2.0))
    drawn = {sampler(logits, history) for _ in range(200)}
    assert len(drawn) > 10  # top_k 1 would have drawn one token; Mirostat alone decided


def test_each_request_keeps_its_own_state():
    a, b = (Sampler(Options(mirostat=2, mirostat_tau=t, temperature=1.0, seed=0)) for t in (2.0, 7.0))
    logits = np.random.default_rng(6).normal(0, 3, 4000)
    for _ in range(50):
        a(logits), b(logits)
    assert a.mu != b.mu and Sampler(Options(mirostat=2, mirostat_tau=2.0)).mu == 4.0


@pytest.mark.parametrize("options,needle", [
    ({"mirostat": 3}, "'mirostat': got 3 (int); accepted: an integer from 0 to 2"),
    ({"mirostat": 2, "mirostat_tau": -1}, "'mirostat_tau': got -1 (int); accepted: a number >= 0"),
    ({"mirostat": 1, "mirostat_eta": "fast"}, "'mirostat_eta': got 'fast' (str)"),
])
def test_bad_values_are_refused_naming_what_is_accepted(options, needle):
    with pytest.raises(OptionsError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Options.from_dict(options)


def test_the_server_generates_with_mirostat_1_and_2(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_path("llama").read_bytes())
    with serving(create_app(models_dir=tmp_path)) as url:
        for version in (1, 2):
            r = requests.post(f"{url}/api/generate", timeout=120, json={
                "model": "tiny", "prompt": "hi", "stream": False,
                "options": {"mirostat": version, "mirostat_tau": 4.0, "mirostat_eta": 0.2, "num_predict": 8,
                            "seed": 1}})
            assert r.status_code == 200, r.text
            assert r.json()["eval_count"] >= 1
        r = requests.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "hi", "options": {"mirostat": 3}},
                          timeout=60)
        assert r.status_code == 400 and "an integer from 0 to 2" in r.json()["error"]


# ---------------------------------------------------------------------------------------------------
# a real model


@pytest.fixture(scope="module")
def smollm2():
    from pyplugin.commands import fetch_demo
    from pyplugin.model import load_model
    from pyplugin.runtime import PebbledModel

    try:
        path = fetch_demo.fetch(ROOT / "models")
    except PebblingError as exc:
        pytest.skip(f"SmolLM2 could not be fetched here: {exc}")
    model = load_model(path, progress=False)
    pebbled = PebbledModel(model)
    yield model, pebbled
    pebbled.close()


@pytest.mark.slow
def test_mirostat_2_on_a_real_model_writes_text_whose_surprise_tracks_tau(smollm2):
    """SmolLM2-135M-Instruct at temperature 1.5, whose own distribution averages 4 to 6 bits a token on
    this prompt: tau 2 and 4 are within its reach. 300 tokens each (fewer where it ends its story)."""
    from pyplugin.runtime import PebblingOptions

    model, pebbled = smollm2
    prompt = model.tokenizer.encode(model.chat_prompt([{"role": "user", "content": "Write a long story about a "
                                                                                   "dragon who learns to cook."}]))
    means, texts = {}, {}
    for tau in (2.0, 4.0):
        options = Options.from_dict({"mirostat": 2, "mirostat_tau": tau, "temperature": 1.5, "seed": 7,
                                     "num_predict": 300, "num_ctx": 1024}, n_ctx_train=model.config.n_ctx_train)
        gen = pebbled.generation(options, PebblingOptions(), len(prompt))
        observed, whole, sample = [], [], gen.sample

        def measured(logits, history):
            token = sample(logits, history)
            observed.append(gen.sampler.surprise)
            whole.append(-math.log2(softmax(np.asarray(logits, np.float64) / 1.5)[token]))
            return token

        gen.sample = measured
        tokens = list(gen.tokens(prompt))
        n, drift = len(observed), 2 * tau - gen.sampler.mu
        assert n >= 100 and abs(drift) < 5  # mu settled
        assert np.mean(observed) - tau == pytest.approx(drift / (0.1 * n), abs=1e-9)
        assert abs(np.mean(observed) - tau) < 5 / (0.1 * 100)  # so within half a bit of tau, at worst
        means[tau], texts[tau] = np.mean(whole), model.tokenizer.decode(tokens)
    assert means[2.0] < means[4.0]  # the text's own surprise under the model follows tau
    assert all(len(text.split()) > 50 for text in texts.values())  # text, words of it

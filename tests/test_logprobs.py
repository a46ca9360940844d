"""logprobs and top_logprobs: each generated token's log-softmax over the raw logits of its step (before
penalties, temperature, truncation and a grammar), computed only when asked, and as Ollama's and
OpenAI's APIs (chat, and the completions API's legacy form) write them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import requests

from helpers import ARCHS, tiny_model, tiny_path
from pyplugin.runtime import Generation, Options
from pyplugin.runtime import generation as generation_module
from server_patch import create_app
from server_patch.local import serving

PROMPT = "The quick brown fox"


def reference_logprobs(model, tokens: list[int]) -> np.ndarray:
    """float64 log-softmax of the logits a fresh forward pass over `tokens` gives for the next token."""
    logits = Generation(model, Options(num_ctx=128)).prefill(tokens).astype(np.float64)
    z = logits - logits.max()
    return z - np.log(np.exp(z).sum())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0, repeat_penalty=1.0),
    # Penalties, temperature and truncation shape what is drawn, never the logprob reported.
    dict(temperature=0.7, top_k=5, top_p=0.8, repeat_penalty=1.6, presence_penalty=0.5, seed=3),
], ids=["greedy", "sampled"])
def test_each_logprob_is_the_log_softmax_of_the_raw_logits_of_its_step(arch, sampling):
    model = tiny_model(arch)
    prompt = model.tokenizer.encode(PROMPT)
    gen = Generation(model, Options(num_ctx=128, num_predict=8, **sampling), logprobs=5)
    generated = list(gen.tokens(prompt))
    assert len(gen.logprobs) == len(generated) > 0
    for i, entry in enumerate(gen.logprobs):
        ref = reference_logprobs(model, prompt + generated[:i])
        assert entry.token == generated[i]
        assert entry.logprob == pytest.approx(ref[generated[i]], abs=2e-4)
        best = np.argsort(-ref, kind="stable")[:5]
        assert [t for t, _ in entry.top] == [int(t) for t in best]
        assert [lp for _, lp in entry.top] == pytest.approx(ref[best], abs=2e-4)
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))  # most likely first
        if sampling["temperature"] == 0.0:
            assert entry.top[0][0] == entry.token  # greedy, no penalty: the chosen token is the likeliest


def test_nothing_is_computed_unless_asked(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr(generation_module, "token_logprob", fail)
    model = tiny_model("llama")
    gen = Generation(model, Options(num_ctx=64, num_predict=4, temperature=0.0))
    assert len(list(gen.tokens(model.tokenizer.encode(PROMPT)))) == 4 and gen.logprobs is None


# ---------------------------------------------------------------------------------------------------
# over HTTP


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_path("qwen2"), root / "tiny.gguf")
    with serving(create_app(models_dir=root)) as url:
        yield url


SEEDED = {"temperature": 0.9, "seed": 11, "num_predict": 10}
# Requests compared with each other unload the model after them (keep_alive 0), so that none starts from
# the KV an earlier one left: the same seed then draws the same tokens.
FRESH = {"keep_alive": 0}


def post(url, path, **body):
    return requests.post(url + path, json={"model": "tiny", **body}, timeout=60)


def same_logprobs(a: list[dict], b: list[dict]) -> bool:
    """The same tokens with the same logprobs, to float32 rounding: a request that continues from cached KV
    computes its first step by another path than a fresh prefill."""
    def flat(entries):
        return [(e["token"], e["bytes"], [t["token"] for t in e.get("top_logprobs", [])]) for e in entries]

    def values(entries):
        return [v for e in entries for v in [e["logprob"], *(t["logprob"] for t in e.get("top_logprobs", []))]]

    return flat(a) == flat(b) and values(a) == pytest.approx(values(b), abs=1e-2)


def text_of_bytes(entries: list[dict]) -> str:
    return b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace")


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_ollama_logprobs_match_the_text_and_stream_the_same(url, path):
    body = {"prompt": PROMPT} if path == "/api/generate" else {"messages": [{"role": "user", "content": PROMPT}]}
    body.update(FRESH)
    r = post(url, path, stream=False, options=SEEDED, logprobs=True, top_logprobs=3, **body).json()
    text = r["response"] if path == "/api/generate" else r["message"]["content"]
    entries = r["logprobs"]
    assert len(entries) == r["eval_count"] and text_of_bytes(entries) == text
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted((t["logprob"] for t in e["top_logprobs"]),
                                                                  reverse=True)
        assert e["logprob"] <= e["top_logprobs"][0]["logprob"]
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", "replace")
    lines = [json.loads(line) for line in post(url, path, stream=True, options=SEEDED, logprobs=True,
                                                top_logprobs=3, **body).iter_lines()]
    streamed = [e for line in lines for e in line.get("logprobs", [])]
    assert same_logprobs(streamed, entries) and "logprobs" not in lines[-1]
    plain = post(url, path, stream=False, options=SEEDED, **body).json()
    assert "logprobs" not in plain
    assert (plain.get("response") or plain.get("message", {}).get("content")) == text  # asking changes nothing


def test_ollama_leaves_out_top_logprobs_unless_asked(url):
    r = post(url, "/api/generate", prompt=PROMPT, stream=False, options=SEEDED, logprobs=True).json()
    assert r["logprobs"] and all(set(e) == {"token", "logprob", "bytes"} for e in r["logprobs"])


def test_openai_chat_logprobs_stream_and_not(url):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "seed": 5, "temperature": 0.8,
            "logprobs": True, "top_logprobs": 2, **FRESH}
    r = post(url, "/v1/chat/completions", **body).json()
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert text_of_bytes(content) == choice["message"]["content"] and len(content) == r["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    events = [json.loads(line[6:]) for line in post(url, "/v1/chat/completions", stream=True, **body).iter_lines()
              if line.startswith(b"data: {")]
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert same_logprobs(streamed, content)
    plain = post(url, "/v1/chat/completions", **{**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_openai_chat_top_logprobs_zero_gives_the_tokens_alone(url):
    r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
             logprobs=True, top_logprobs=0).json()
    assert all(e["top_logprobs"] == [] for e in r["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("stream", [False, True])
def test_openai_completions_legacy_logprobs(url, stream):
    r = post(url, "/v1/completions", prompt=PROMPT, max_tokens=8, seed=2, temperature=0.9, logprobs=4, stream=stream)
    if stream:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith(b"data: {")]
        text = "".join(c["text"] for c in chunks)
        lp = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]]
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    else:
        choice = r.json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    assert all(len(top) <= 4 and max(top.values()) >= chosen for top, chosen in zip(lp["top_logprobs"],
                                                                                    lp["token_logprobs"]))
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == text or "\ufffd" in "".join(lp["tokens"])  # split characters aside
    before, checked = "", 0
    for token, start in zip(lp["tokens"], lp["text_offset"]):
        if "\ufffd" not in token + before:  # all whole characters so far: the token starts where they end
            assert start == len(before) and text[start:start + len(token)] == token
            checked += 1
        before += token
    assert checked


@pytest.mark.parametrize("path, body, needle", [
    ("/api/generate", {"prompt": "x", "logprobs": True, "top_logprobs": 21}, "0 to 20"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "'logprobs': true"),
    ("/api/generate", {"prompt": "x", "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": -1}, "0 to 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "number of most likely tokens"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "'logprobs': N"),
])
def test_bad_logprobs_requests_say_what_is_wrong(url, path, body, needle):
    r = post(url, path, stream=False, **body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert needle in (error["message"] if path.startswith("/v1") else error)

"""Embeddings on /api/embed, /api/embeddings and /v1/embeddings: the pooling the GGUF declares over the
model's final hidden states, against a float64 reference of that pooling, unit length, and the same
vectors under every strategy (they share the model's store and plan like any request)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import requests

from pyplugin.model import load_model
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import Generation, Options
from pyplugin.store import select_backend
from server_patch import create_app
from server_patch.local import serving

TINY = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=256)
TEXTS = ["The quick brown fox.", "A memory plugin moves layers between tiers.", "x"]
POOLINGS = {"mean": None, "cls": 2, "last": 3}  # pooling_type in the file; mean where there is none
F16 = {"pebbling_weights": "f16"}  # float32 on the host: the served pass is the resident one, bit for bit
# On a GPU the served pass rounds each matrix product's activations to fp16 (2^-11 relative) where the
# reference (numpy, float32) does not: seen there, 2.7e-4 at most after 4 layers; 1e-4 holds on the host.
ATOL = 1e-3 if select_backend().name == "cuda" else 1e-4


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for name, pooling in POOLINGS.items():
        write_gguf(root / f"{name}.gguf", **TINY, metadata={} if pooling is None else {"llama.pooling_type": pooling})
    write_gguf(root / "reranker.gguf", **TINY, metadata={"llama.pooling_type": 4})
    return root


@pytest.fixture(scope="module")
def url(models_dir):
    with serving(create_app(models_dir=models_dir)) as url:
        yield url


def reference(path: Path, text: str, pooling: str) -> np.ndarray:
    """The hidden states of the resident forward pass, pooled and normalised in float64 here."""
    model = load_model(path, weights="f16", progress=False)
    tokens = model.tokenizer.encode(text)
    hidden = Generation(model, Options(num_ctx=64)).hidden_states(tokens).astype(np.float64)
    vector = {"mean": hidden.mean(axis=0), "cls": hidden[0], "last": hidden[-1]}[pooling]
    return vector / np.sqrt(np.sum(vector * vector))


def embed(url: str, model: str, inputs, **body) -> requests.Response:
    return requests.post(f"{url}/api/embed", json={"model": model, "input": inputs, **body}, timeout=60)


@pytest.mark.parametrize("pooling", list(POOLINGS))
def test_vectors_equal_a_float64_reference_of_the_declared_pooling(url, models_dir, pooling):
    r = embed(url, pooling, TEXTS, options=F16)
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["embeddings"])
    assert got.shape == (len(TEXTS), TINY["n_embd"])
    for text, vector in zip(TEXTS, got):
        np.testing.assert_allclose(vector, reference(models_dir / f"{pooling}.gguf", text, pooling), atol=ATOL)
        assert abs(np.linalg.norm(vector) - 1) < 1e-6
    assert r.json()["prompt_eval_count"] > len(TEXTS)


def test_the_poolings_differ(url):
    vectors = {p: np.asarray(embed(url, p, TEXTS[1], options=F16).json()["embeddings"][0]) for p in POOLINGS}
    assert not np.allclose(vectors["mean"], vectors["cls"]) and not np.allclose(vectors["cls"], vectors["last"])


@pytest.mark.parametrize("weights", ["f16", "quantized"])
def test_every_strategy_gives_the_same_vectors(url, weights):
    vectors = {}
    for strategy in ("none", "sqrt", "minimal", "every:2", "adaptive"):
        r = embed(url, "mean", TEXTS, options={"pebbling_strategy": strategy, "pebbling_weights": weights})
        assert r.status_code == 200 and r.json()["pebbling"]["strategy"].startswith(strategy.split(":")[0])
        vectors[strategy] = np.asarray(r.json()["embeddings"])
    for strategy, got in vectors.items():
        np.testing.assert_array_equal(got, vectors["none"], err_msg=strategy)
    assert vectors["minimal"].shape == (3, TINY["n_embd"])


def test_dimensions_truncate_and_renormalise(url):
    full = np.asarray(embed(url, "mean", TEXTS[0]).json()["embeddings"][0])
    short = np.asarray(embed(url, "mean", TEXTS[0], dimensions=16).json()["embeddings"][0])
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)


def test_a_long_input_is_truncated_to_num_ctx_unless_told_not_to(url):
    long = "word " * 400
    r = embed(url, "mean", long, options={"num_ctx": 32})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == 32
    r = embed(url, "mean", long, options={"num_ctx": 32}, truncate=False)
    assert r.status_code == 400 and "more than num_ctx (32)" in r.json()["error"]


def test_the_legacy_endpoint_returns_one_vector_not_normalised(url):
    r = requests.post(f"{url}/api/embeddings", json={"model": "mean", "prompt": TEXTS[0]}, timeout=60)
    legacy = np.asarray(r.json()["embedding"])
    unit = np.asarray(embed(url, "mean", TEXTS[0]).json()["embeddings"][0])
    np.testing.assert_allclose(legacy / np.linalg.norm(legacy), unit, atol=1e-6)
    assert abs(np.linalg.norm(legacy) - 1) > 1e-3


def test_the_openai_endpoint_in_floats_and_base64(url):
    body = {"model": "mean", "input": TEXTS[:2]}
    floats = requests.post(f"{url}/v1/embeddings", json=body, timeout=60).json()
    packed = requests.post(f"{url}/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60).json()
    assert floats["object"] == "list" and [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 0
    for f, p in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, f["embedding"], rtol=1e-6)
    ollama = np.asarray(embed(url, "mean", TEXTS[:2]).json()["embeddings"])
    np.testing.assert_allclose(np.asarray([d["embedding"] for d in floats["data"]]), ollama, atol=1e-7)


@pytest.mark.parametrize("path,body,status,needle", [
    ("/api/embed", {"model": "reranker", "input": "x"}, 400, "pooling_type is 'rank'"),
    ("/api/embed", {"model": "mean", "input": [""]}, 400, "input 0 is empty"),
    ("/api/embed", {"model": "mean", "input": "x", "dimensions": 0}, 400, "dimensions"),
    ("/api/embed", {"model": "absent", "input": "x"}, 404, "not found"),
    ("/v1/embeddings", {"model": "mean", "input": [[1, 2, 3]]}, 400, "token-id arrays"),
    ("/v1/embeddings", {"model": "mean", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
])
def test_bad_embedding_requests_say_what_is_wrong(url, path, body, status, needle):
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in (error["message"] if isinstance(error, dict) else error)


def test_an_empty_input_list_loads_the_model_and_returns_no_vectors(url):
    r = embed(url, "mean", [])
    assert r.status_code == 200 and r.json()["embeddings"] == []

"""Fill in the middle: /api/generate's `suffix` (and /v1/completions'), as Ollama serves it. A model whose
Go template reads .Suffix renders Prompt and Suffix through it (Ollama's qwen2.5-coder template); a GGUF
whose vocabulary has FIM tokens (Qwen2.5-Coder's <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, found
by text or by the file's ids, as llama.cpp finds them) gets <|fim_prefix|>{prompt}<|fim_suffix|>{suffix}
<|fim_middle|>, token for token; a model with neither answers 400, as Ollama's "does not support
insert"."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from helpers import tiny_path
from pyplugin.model import load_model
from pyplugin.model.vocabulary import fim_token_ids
from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving
from test_ollama_store import add_model

CODER = dict(arch="qwen2", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=512, vocab="coder")
# Ollama's template for qwen2.5-coder, its insert branch first (the chat branches shortened).
QWEN_CODER_TEMPLATE = (
    "{{- if .Suffix }}<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>\n"
    "{{- else if .Messages }}{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n{{- else }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n{{ end }}")
# CodeLlama's, as Ollama has it: a template that knows a suffix, on a vocabulary without FIM tokens.
CODELLAMA_TEMPLATE = "{{- if .Suffix }}<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>{{- else }}{{ .Prompt }}{{- end }}"
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "coder.gguf", **CODER)
    write_gguf(root / "chat.gguf", **{**CODER, "vocab": "chatml"})
    return root


@pytest.fixture(scope="module")
def url(models, tmp_path_factory):
    store = tmp_path_factory.mktemp("ollama")
    coder, chat = (models / "coder.gguf").read_bytes(), (models / "chat.gguf").read_bytes()
    add_model(store, "registry.ollama.ai", "library", "qwen2.5-coder", "tiny", data=coder,
              layers={"template": QWEN_CODER_TEMPLATE})
    add_model(store, "registry.ollama.ai", "me", "codellama", "latest", data=chat,
              layers={"template": CODELLAMA_TEMPLATE})
    add_model(store, "registry.ollama.ai", "me", "chatty", "latest", data=chat,
              layers={"template": "{{ .System }}{{ .Prompt }}"})
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(store))
    with serving(create_app(models_dir=models)) as url:
        yield url
    patch.undo()


def generate(url, model: str, **fields) -> requests.Response:
    return requests.post(f"{url}/api/generate", timeout=120, json={
        "model": model, "stream": False, **fields,
        "options": {"temperature": 0, "num_predict": 1, "pebbling_cache_prompt": False}})  # every token evaluated


def prompt_tokens(response: requests.Response) -> list[int]:
    """The ids the prompt became: the start of the response's context, as many as were evaluated."""
    assert response.status_code == 200, response.text
    body = response.json()
    return body["context"][:body["prompt_eval_count"]]


def fim_sequence(tokenizer, prefix: str, suffix: str) -> list[int]:
    pre, suf, mid = tokenizer.fim
    return [pre, *tokenizer.encode_fragment(prefix), suf, *tokenizer.encode_fragment(suffix), mid]


def test_the_vocabularys_fim_tokens_are_found_by_text_or_by_the_files_ids(models):
    tokenizer = load_model(models / "coder.gguf", progress=False).tokenizer
    assert [tokenizer.tokens[i] for i in tokenizer.fim] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    assert {tokenizer.tokens.index(t) for t in ("<|fim_pad|>", "<|file_sep|>")} <= tokenizer.eog_ids  # llama.cpp's
    assert load_model(models / "chat.gguf", progress=False).tokenizer.fim is None
    ids = {"tokenizer.ggml.fim_pre_token_id": np.uint32(7), "tokenizer.ggml.fim_suf_token_id": np.uint32(8),
           "tokenizer.ggml.fim_mid_token_id": np.uint32(9)}
    given = load_model(tiny_path("qwen2", vocab="chatml", metadata=ids), progress=False).tokenizer
    assert given.fim == (7, 8, 9)
    tokens = ["a", "\u2581<SUF>", "<PRE>", "\u2581<MID>", "<|fim_prefix|>"]
    assert fim_token_ids(tokens) == (4, 1, 3)  # Qwen's name before CodeLlama's, as llama.cpp looks


def test_a_gguf_with_fim_tokens_gets_the_fim_prompt_token_for_token(url, models):
    tokenizer = load_model(models / "coder.gguf", progress=False).tokenizer
    r = generate(url, "coder", prompt=PREFIX, suffix=SUFFIX)
    assert prompt_tokens(r) == fim_sequence(tokenizer, PREFIX, SUFFIX)
    # a system message has no place in a FIM prompt (Ollama passes only Prompt and Suffix)
    assert prompt_tokens(generate(url, "coder", prompt=PREFIX, suffix=SUFFIX, system="Be brief.")) == \
        prompt_tokens(r)


def test_a_go_template_that_reads_suffix_renders_it(url, models):
    coder = load_model(models / "coder.gguf", progress=False).tokenizer
    r = generate(url, "qwen2.5-coder:tiny", prompt=PREFIX, suffix=SUFFIX)
    assert prompt_tokens(r) == fim_sequence(coder, PREFIX, SUFFIX)  # Ollama's template: the same prompt
    chat = load_model(models / "chat.gguf", progress=False).tokenizer
    r = generate(url, "me/codellama", prompt=PREFIX, suffix=SUFFIX)
    assert prompt_tokens(r) == chat.encode(f"<PRE> {PREFIX} <SUF>{SUFFIX} <MID>")
    # a request's own template that reads .Suffix, on a model that knows none
    r = generate(url, "chat", prompt="a", suffix="b", template="[{{ .Suffix }}|{{ .Prompt }}]")
    assert prompt_tokens(r) == chat.encode("[b|a]")


def test_a_model_with_neither_does_not_support_insert(url):
    for name in ("chat", "me/chatty"):
        r = generate(url, name, prompt=PREFIX, suffix=SUFFIX)
        assert r.status_code == 400
        assert r.json()["error"].startswith(f"{name} does not support insert")
    assert generate(url, "chat", prompt=PREFIX, suffix="").status_code == 200  # an empty suffix: none


def test_what_would_lose_the_suffix_is_refused(url):
    r = generate(url, "coder", prompt=PREFIX, suffix=SUFFIX, raw=True)
    assert r.status_code == 400 and "leave out raw" in r.json()["error"]
    r = generate(url, "coder", prompt=PREFIX, suffix=SUFFIX, template="{{ .Prompt }}")
    assert r.status_code == 400 and "does not read .Suffix" in r.json()["error"]


def test_show_says_which_models_take_a_suffix(url):
    def capabilities(name: str) -> list[str]:
        return requests.post(f"{url}/api/show", json={"model": name}, timeout=30).json()["capabilities"]

    assert "insert" in capabilities("coder") and "insert" in capabilities("me/codellama")
    assert "insert" not in capabilities("chat") and "insert" not in capabilities("me/chatty")


def test_openai_completions_take_a_suffix(url, models):
    tokenizer = load_model(models / "coder.gguf", progress=False).tokenizer
    r = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(fim_sequence(tokenizer, PREFIX, SUFFIX))
    r = requests.post(f"{url}/v1/completions", timeout=60, json={"model": "chat", "prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and "does not support insert" in r.json()["error"]["message"]

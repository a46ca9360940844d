"""Models made with `ollama create`: a store laid out as Ollama lays it out, whose manifests carry
template, system, params, messages and license layers, served as Ollama serves them."""

from __future__ import annotations

import json

import pytest
import requests

from ollama_templates import TEMPLATES
from pyplugin.model import load_model
from pyplugin.model.synth import write_gguf
from pyplugin.serving.go_template import GoTemplate
from pyplugin.serving import Engine
from server_patch import create_app
from server_patch.local import serving
from test_ollama_store import add_model

TINY = dict(arch="qwen2", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=512)
PARAMS = {"num_predict": 3, "temperature": 0, "stop": ["never-written"], "typical_p": 0.5}
LICENSE = "Use it kindly."
LIBRARY_PARAMS = {"num_predict": 2, "temperature": 0, "stop": ["<end_of_turn>"]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    gguf = root / "model.gguf"
    write_gguf(gguf, **TINY)
    data = gguf.read_bytes()
    add_model(root, "registry.ollama.ai", "me", "mario", "latest", data=data, layers={
        "template": TEMPLATES["phi-3"], "system": "You are Mario.", "params": json.dumps(PARAMS),
        "license": LICENSE})
    add_model(root, "registry.ollama.ai", "library", "plain", "latest", data=data)
    # Under Ollama's default namespace, as `ollama pull gemma3:270m` writes it.
    add_model(root, "registry.ollama.ai", "library", "luigi", "270m", data=data, layers={
        "template": TEMPLATES["gemma3-instruct"], "system": "You are Luigi.",
        "params": json.dumps(LIBRARY_PARAMS)})
    add_model(root, "registry.ollama.ai", "me", "greeter", "latest", data=data, layers={
        "template": TEMPLATES["gemma3-instruct"],
        "messages": json.dumps([{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}])})
    add_model(root, "registry.ollama.ai", "me", "lora", "latest", data=data, layers={"adapter": "weights"})
    wrong = root / "wrong.gguf"
    write_gguf(wrong, **TINY)
    blob = wrong.read_bytes().replace(b"qwen2", b"qwen9")  # an architecture pebbling does not serve
    add_model(root, "registry.ollama.ai", "library", "future", "latest", data=blob)
    return root, gguf


@pytest.fixture(scope="module")
def url(store, tmp_path_factory):
    root, _ = store
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(root))
    with serving(create_app(models_dir=tmp_path_factory.mktemp("empty"))) as url:
        yield url
    patch.undo()


def chat(url, model, messages, **body):
    r = requests.post(f"{url}/api/chat", json={"model": model, "messages": messages, "stream": False, **body},
                      timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_tokens(store, text: str) -> int:
    return len(load_model(store[1], progress=False).tokenizer.encode(text))


def test_the_template_system_and_params_layers_apply(url, store):
    question = [{"role": "user", "content": "Who are you?"}]
    r = chat(url, "me/mario", question)
    # The Go template layer renders the conversation with the system layer's message first.
    expected = GoTemplate(TEMPLATES["phi-3"]).render_chat([{"role": "system", "content": "You are Mario."}] + question)
    assert expected.startswith("<|system|>\nYou are Mario.<|end|>\n<|user|>\nWho are you?")
    assert r["prompt_eval_count"] + r["pebbling"]["cached_tokens"] == prompt_tokens(store, expected)
    assert r["eval_count"] == 3 and r["done_reason"] == "length"  # PARAMETER num_predict 3
    # A request's own options and system message win over the layers'.
    own = chat(url, "me/mario", [{"role": "system", "content": "Be Luigi."}] + question,
               options={"num_predict": 5})
    assert own["eval_count"] == 5
    luigi = GoTemplate(TEMPLATES["phi-3"]).render_chat([{"role": "system", "content": "Be Luigi."}] + question)
    assert own["prompt_eval_count"] + own["pebbling"]["cached_tokens"] == prompt_tokens(store, luigi)


def test_the_messages_layer_opens_every_chat(url, store):
    question = [{"role": "user", "content": "And now?"}]
    r = chat(url, "me/greeter", question, options={"num_predict": 1})
    expected = GoTemplate(TEMPLATES["gemma3-instruct"]).render_chat(
        [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}] + question)
    assert r["prompt_eval_count"] + r["pebbling"]["cached_tokens"] == prompt_tokens(store, expected)


def test_show_reports_the_layers_as_ollama_does(url):
    show = requests.post(f"{url}/api/show", json={"model": "me/mario"}, timeout=30).json()
    assert show["template"] == TEMPLATES["phi-3"] and show["system"] == "You are Mario."
    assert show["license"] == LICENSE
    assert show["parameters"].splitlines() == ['num_predict     3', 'temperature     0', 'stop            "never-written"',
                                               'typical_p       0.5']
    assert "FROM me/mario:latest" in show["modelfile"] and 'SYSTEM """You are Mario."""' in show["modelfile"]
    assert 'PARAMETER stop            "never-written"' in show["modelfile"]
    assert show["capabilities"] == ["completion"]
    assert any("typical_p" in note for note in show["pebbling_notes"])  # said, not applied


def test_capabilities_follow_what_the_template_can_do(url):
    plain = requests.post(f"{url}/api/show", json={"model": "plain"}, timeout=30).json()
    assert "tools" in plain["capabilities"]  # the GGUF's own ChatML template takes tools
    assert "pebbling_notes" not in plain


def test_a_model_with_an_adapter_is_refused_naming_it(url):
    r = requests.post(f"{url}/api/chat", json={"model": "me/lora", "messages": [{"role": "user", "content": "x"}],
                                               "stream": False}, timeout=30)
    assert r.status_code == 400 and "me/lora" in r.json()["error"] and "adapter (LoRA)" in r.json()["error"]
    show = requests.post(f"{url}/api/show", json={"model": "me/lora"}, timeout=30).json()
    assert any("adapter" in note for note in show["pebbling_notes"])


def test_a_listed_model_of_an_unsupported_architecture_says_why(url, store):
    names = [m["name"] for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]]
    assert "future:latest" in names
    show = requests.post(f"{url}/api/show", json={"model": "future"}, timeout=30).json()
    assert any("'qwen9' is not supported" in note for note in show["pebbling_notes"])
    r = requests.post(f"{url}/api/generate", json={"model": "future", "prompt": "x", "stream": False}, timeout=30)
    assert r.status_code == 400 and "model 'future'" in r.json()["error"] and "qwen9" in r.json()["error"]
    assert str(store[0]) not in r.text


def test_a_library_model_keeps_its_layers_as_ollama_pull_writes_it(url, store, monkeypatch):
    """A model in the default `library` namespace (a plain name, as `ollama pull gemma3:270m` stores it)
    is served with its template, system and params layers: the prompt is the template's, token for token."""
    show = requests.post(f"{url}/api/show", json={"model": "luigi:270m"}, timeout=30).json()
    assert show["template"] == TEMPLATES["gemma3-instruct"] and show["system"] == "You are Luigi."
    assert show["parameters"].splitlines() == ["num_predict     2", "temperature     0",
                                               'stop            "<end_of_turn>"']
    seen = []
    original = Engine._prompt_tokens

    def spy(self, *args, **kwargs):
        tokens = original(self, *args, **kwargs)
        seen.append(tokens[0])
        return tokens

    monkeypatch.setattr(Engine, "_prompt_tokens", spy)
    question = [{"role": "user", "content": "Who are you?"}]
    r = chat(url, "luigi:270m", question)
    expected = GoTemplate(TEMPLATES["gemma3-instruct"]).render_chat(
        [{"role": "system", "content": "You are Luigi."}] + question)
    assert expected.startswith("<start_of_turn>user\nYou are Luigi.")
    assert seen == [load_model(store[1], progress=False).tokenizer.encode(expected)]
    assert r["eval_count"] == 2 and r["done_reason"] == "length"  # PARAMETER num_predict 2

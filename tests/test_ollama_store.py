"""Resolving models in Ollama's local store by name, and refusing names that could name a path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pyplugin.serving import ollama_store
from pyplugin.errors import ModelError
from pyplugin.serving.ollama_store import InvalidModelName, list_models, parse_name, resolve


def add_blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return digest


def add_model(root: Path, host: str, namespace: str, model: str, tag: str, data: bytes = b"GGUF...",
              media_type: str = ollama_store.MODEL_MEDIA_TYPE, write_blob: bool = True,
              layers: dict[str, str] | None = None) -> Path:
    """A model in Ollama's layout; `layers`: Modelfile layers by kind (template, system, params, ...)."""
    digest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    if write_blob:
        blob.write_bytes(data)
    extra = [{"mediaType": f"application/vnd.ollama.image.{kind}", "digest": "sha256:" + add_blob(root, text.encode()),
              "size": len(text.encode())} for kind, text in (layers or {}).items()]
    manifest = root / "manifests" / host / namespace / model / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [{"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}, *extra],
    }))
    return blob


def test_name_defaults_to_library_and_latest():
    assert parse_name("llama3.2") == parse_name("registry.ollama.ai/library/llama3.2:latest")
    assert parse_name("llama3.2:1b").tag == "1b"
    assert parse_name("me/tiny:q4_K_M").display == "me/tiny:q4_K_M"
    assert parse_name("hf.co/org/tiny:Q8_0").display == "hf.co/org/tiny:Q8_0"
    assert parse_name("localhost:5000/ns/m").host == "localhost:5000"


@pytest.mark.parametrize("name", ["../x", "..", "a/../b", "/etc/passwd", "a\\b", "x:..", "a//b", "",
                                  ".hidden", "a/b/c/d", "m:", "m:a/b", "nul\x00byte", "-dash"])
def test_names_that_could_name_a_path_are_refused_before_file_access(name, monkeypatch):
    def no_fs(*args, **kwargs):
        raise AssertionError("the file system was touched")

    monkeypatch.setattr(Path, "is_file", no_fs)
    monkeypatch.setattr(Path, "read_text", no_fs)
    with pytest.raises(InvalidModelName, match="invalid model name"):
        resolve(name, root=Path("/nonexistent"))


def test_resolves_the_model_layer_blob(tmp_path, monkeypatch):
    blob = add_model(tmp_path, "registry.ollama.ai", "library", "tiny", "latest", b"GGUF-tiny")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    found = resolve("tiny")
    assert found.path == blob and found.size == 9 and found.name == "tiny:latest"
    assert found.digest == "sha256:" + hashlib.sha256(b"GGUF-tiny").hexdigest()
    assert resolve("tiny:latest") == found
    assert resolve("tiny:other") is None
    assert resolve("absent") is None


def test_store_defaults_to_home_ollama_models(tmp_path, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ollama_store.models_dir() == tmp_path / ".ollama" / "models"
    add_model(tmp_path / ".ollama" / "models", "registry.ollama.ai", "library", "tiny", "v1")
    assert resolve("tiny:v1").name == "tiny:v1"


def test_missing_blob_says_to_pull_again(tmp_path):
    add_model(tmp_path, "registry.ollama.ai", "library", "tiny", "latest", write_blob=False)
    with pytest.raises(ModelError, match="ollama pull tiny:latest"):
        resolve("tiny", root=tmp_path)


def test_lists_models_with_a_model_layer_only(tmp_path):
    add_model(tmp_path, "registry.ollama.ai", "library", "b", "latest", b"1")
    add_model(tmp_path, "registry.ollama.ai", "me", "a", "q4", b"22")
    add_model(tmp_path, "hf.co", "org", "c", "Q8_0", b"333")
    add_model(tmp_path, "registry.ollama.ai", "library", "adapter", "latest", b"4444",
              media_type="application/vnd.ollama.image.adapter")
    add_model(tmp_path, "registry.ollama.ai", "library", "partial", "latest", b"55555", write_blob=False)
    assert [(m.name, m.size) for m in list_models(tmp_path)] == [
        ("b:latest", 1), ("hf.co/org/c:Q8_0", 3), ("me/a:q4", 2)]
    assert list_models(tmp_path / "absent") == []


def test_a_modelfiles_layers_are_read(tmp_path):
    add_model(tmp_path, "registry.ollama.ai", "me", "mario", "7b", layers={
        "template": "{{ .Prompt }}", "system": "You are Mario.", "params": '{"temperature": 0.2, "stop": ["END"]}',
        "messages": '[{"role": "user", "content": "hi"}]', "license": "MIT", "adapter": "lora bytes"})
    layers = resolve("me/mario:7b", tmp_path).layers
    assert (layers.template, layers.system, layers.params, layers.messages, layers.license, layers.unsupported) == (
        "{{ .Prompt }}", "You are Mario.", {"temperature": 0.2, "stop": ["END"]},
        ({"role": "user", "content": "hi"},), "MIT", ("an adapter (LoRA) layer",))
    assert resolve("me/mario:7b", tmp_path).path.read_bytes() == b"GGUF..."


def test_a_params_layer_that_is_not_json_is_an_error_naming_the_model(tmp_path):
    add_model(tmp_path, "registry.ollama.ai", "library", "bad", "latest", layers={"params": "{temperature"})
    with pytest.raises(ModelError, match="model 'bad:latest': its params or messages layer is not valid JSON"):
        resolve("bad", tmp_path)


def test_the_linux_services_store_is_searched_after_the_users(tmp_path, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    service = tmp_path / "service"
    monkeypatch.setattr(ollama_store, "SERVICE_STORE", service)
    add_model(service, "registry.ollama.ai", "library", "only-there", "latest", data=b"service")
    add_model(service, "registry.ollama.ai", "library", "both", "latest", data=b"service")
    add_model(tmp_path / "home" / ".ollama" / "models", "registry.ollama.ai", "library", "both", "latest",
              data=b"user")
    assert resolve("only-there").path.read_bytes() == b"service"
    assert resolve("both").path.read_bytes() == b"user"
    assert [m.name for m in list_models()] == ["both:latest", "only-there:latest"]
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "elsewhere"))  # set: the only store
    assert resolve("only-there") is None and list_models() == []

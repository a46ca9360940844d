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
    with pytest.raises(ModelError, match="model 'bad:latest': its params layer is not valid JSON"):
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


# ---------------------------------------------------------------------------------------------------
# broken manifests and links out of the store: refused, naming the model and never a path


def _manifest(root: Path, model: str) -> Path:
    return root / "manifests" / "registry.ollama.ai" / "library" / model / "latest"


@pytest.fixture
def broken_store(tmp_path, monkeypatch):
    """Ollama's store holding a working model and every kind of broken one; a GGUF model and a secret
    outside it, which links in the store point to."""
    from pyplugin.model.synth import write_gguf

    store, outside = tmp_path / "ollama-store", tmp_path / "outside"
    outside.mkdir()
    gguf = write_gguf(outside / "real.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=64)
    secret = outside / "secret.txt"
    secret.write_text("s3cr3t:x:0:0")
    add_model(store, "registry.ollama.ai", "library", "good", "latest", gguf.read_bytes())
    add_model(store, "registry.ollama.ai", "library", "not-json", "latest")
    _manifest(store, "not-json").write_text("{not json")
    add_model(store, "registry.ollama.ai", "library", "no-layer", "latest",
              media_type="application/vnd.ollama.image.adapter")
    add_model(store, "registry.ollama.ai", "library", "bad-digest", "latest")
    _manifest(store, "bad-digest").write_text(json.dumps({"layers": [
        {"mediaType": ollama_store.MODEL_MEDIA_TYPE, "digest": "sha256:xyz"}]}))
    add_model(store, "registry.ollama.ai", "library", "no-blob", "latest", b"absent", write_blob=False)
    # a model blob that links to a GGUF file outside the store
    digest = hashlib.sha256(b"linked model").hexdigest()
    add_model(store, "registry.ollama.ai", "library", "blob-link", "latest", b"linked model", write_blob=False)
    (store / "blobs" / f"sha256-{digest}").symlink_to(gguf)
    # a license layer that links to a secret outside the store
    blob = add_model(store, "registry.ollama.ai", "library", "license-link", "latest", gguf.read_bytes() + b"\0",
                     layers={"license": "placeholder"})
    license_blob = store / "blobs" / f"sha256-{hashlib.sha256(b'placeholder').hexdigest()}"
    license_blob.unlink()
    license_blob.symlink_to(secret)
    assert blob.is_file()
    # a manifest that links to one outside the store (naming the good model's blob)
    outside_manifest = outside / "manifest.json"
    outside_manifest.write_text(_manifest(store, "good").read_text())
    _manifest(store, "manifest-link").parent.mkdir(parents=True)
    _manifest(store, "manifest-link").symlink_to(outside_manifest)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    return store, tmp_path


BROKEN = {"not-json": "names no model layer", "no-layer": "names no model layer", "bad-digest": "sha256:<64 hex>",
          "no-blob": "ollama pull no-blob:latest", "blob-link": "outside the store",
          "license-link": "outside the store", "manifest-link": "outside the store"}


@pytest.mark.parametrize("model", list(BROKEN))
def test_a_broken_or_linked_out_model_is_an_error_naming_it_and_no_path(broken_store, model):
    store, tmp_path = broken_store
    with pytest.raises(ModelError) as caught:
        resolve(model)
    message = str(caught.value)
    assert f"model '{model}:latest'" in message and BROKEN[model] in message, message
    assert str(tmp_path) not in message and str(tmp_path.resolve()) not in message and "/manifests" not in message
    assert model not in [m.name.split(":")[0] for m in list_models()]  # not listed either
    assert resolve("good").name == "good:latest"


@pytest.fixture
def broken_server(broken_store, tmp_path_factory):
    from server_patch import create_app
    from server_patch.local import serving

    app = create_app(models_dir=tmp_path_factory.mktemp("models"))
    with serving(app) as url:
        yield url, broken_store[1]
    app.state.engine.close()


@pytest.mark.parametrize("model", list(BROKEN))
def test_the_server_answers_a_broken_or_linked_out_model_naming_it_and_no_path(broken_server, model):
    import requests

    url, tmp_path = broken_server
    for method, path, body in (("post", "/api/generate", {"model": model, "prompt": "hi", "stream": False}),
                               ("post", "/api/show", {"model": model}),
                               ("post", "/api/chat", {"model": model, "messages": [], "stream": False}),
                               ("get", f"/v1/models/{model}", None)):
        r = getattr(requests, method)(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert str(tmp_path) not in r.text and str(tmp_path.resolve()) not in r.text, (path, r.text)
        assert "s3cr3t" not in r.text and "/manifests" not in r.text and BROKEN[model] in r.text, (path, r.text)
    names = [m["name"] for m in requests.get(url + "/api/tags", timeout=60).json()["models"]]
    assert "good:latest" in names and f"{model}:latest" not in names
    r = requests.post(url + "/api/generate", json={"model": "good", "prompt": "hi", "stream": False,
                                                   "options": {"num_predict": 1}}, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 1

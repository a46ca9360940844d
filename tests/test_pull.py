"""/api/pull and `pebbling pull` against a registry served on loopback (tests/registry.py): Ollama's
protocol and progress objects, the model written to Ollama's store layout and served with its layers,
a download cut off and resumed (within a pull, and by the next pull), a corrupted blob refused and
removed, and a name the registry does not have."""

from __future__ import annotations

import json

import pytest
import requests

from helpers import tiny_path
from pyplugin.cli import main
from registry import serving_registry
from server_patch import create_app
from server_patch.local import serving

TEMPLATE = "{{ range .Messages }}<{{ .Role }}>{{ .Content }}{{ end }}<assistant>"


def gguf(seed: int) -> bytes:
    """A GGUF of its own (a blob no other test has pulled)."""
    return tiny_path("llama", seed=seed).read_bytes()


@pytest.fixture(scope="module")
def registry():
    with serving_registry() as registry:
        registry.add("library", "tiny", "latest", {"model": tiny_path("llama").read_bytes(),
                                                   "template": TEMPLATE.encode(), "system": b"Be brief."})
        yield registry


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("ollama")


@pytest.fixture(scope="module")
def url(registry, store, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(store))
    patch.setenv("PEBBLING_REGISTRY", registry.url)
    with serving(create_app(models_dir=tmp_path_factory.mktemp("models"))) as url:
        yield url
    patch.undo()


def pull(url, name: str, stream: bool = True) -> requests.Response:
    return requests.post(f"{url}/api/pull", json={"model": name, "stream": stream}, timeout=60)


def lines(r: requests.Response) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines()]


def listed(url) -> set[str]:
    return {m["name"] for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]}


def blob(store, digest: str):
    return store / "blobs" / digest.replace(":", "-")


def test_pull_streams_ollamas_progress_and_serves_the_model_with_its_layers(url, registry, store):
    r = pull(url, "tiny")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    progress = lines(r)
    statuses = [p["status"] for p in progress]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    manifest = json.loads(registry.manifests[("library", "tiny", "latest")])
    for layer in [*manifest["layers"], manifest["config"]]:
        mine = [p for p in progress if p.get("digest") == layer["digest"]]
        assert mine and mine[0]["status"] == f"pulling {layer['digest'][7:19]}"
        assert all(p["total"] == layer["size"] for p in mine) and mine[-1]["completed"] == layer["size"]
        assert blob(store, layer["digest"]).read_bytes() == registry.blobs[layer["digest"]]
    assert (store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest").read_bytes() == \
        registry.manifests[("library", "tiny", "latest")]
    assert "tiny:latest" in listed(url)
    show = requests.post(f"{url}/api/show", json={"model": "tiny"}, timeout=30).json()
    assert show["template"] == TEMPLATE and show["system"] == "Be brief."
    chat = requests.post(f"{url}/api/chat", json={"model": "tiny", "stream": False, "options": {"num_predict": 1},
                                                  "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert chat.status_code == 200, chat.text
    # Pulled again: the blobs are there, nothing is downloaded.
    before = len(registry.requests)
    assert lines(pull(url, "tiny"))[-1] == {"status": "success"}
    assert [path for path, _ in registry.requests[before:]] == ["/v2/library/tiny/manifests/latest"]


def test_a_download_cut_off_is_resumed_where_it_stopped(url, registry, store):
    data = gguf(1)
    digest = registry.add("library", "cut", "v1", {"model": data})["model"]
    registry.cut[digest] = 1
    r = pull(url, "cut:v1", stream=False)
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    assert registry.ranges(digest) == [None, f"bytes={len(data) // 2}-"]
    assert blob(store, digest).read_bytes() == data
    assert "cut:v1" in listed(url)


def test_a_pull_that_fails_leaves_its_partial_download_for_the_next_to_resume(url, registry, store):
    data = gguf(2)
    digest = registry.add("library", "flaky", "latest", {"model": data})["model"]
    registry.cut[digest] = 100  # more than a pull retries
    r = pull(url, "flaky", stream=False)
    assert r.status_code == 502 and "broke off" in r.json()["error"] and "pull again to resume" in r.json()["error"]
    partial = store / "blobs" / f"{digest.replace(':', '-')}.pebbling-partial"
    kept = partial.stat().st_size
    assert 0 < kept < len(data) and partial.read_bytes() == data[:kept]
    assert "flaky:latest" not in listed(url)
    registry.cut[digest] = 0
    seen = len(registry.ranges(digest))
    assert lines(pull(url, "flaky"))[-1] == {"status": "success"}
    assert registry.ranges(digest)[seen:] == [f"bytes={kept}-"]
    assert blob(store, digest).read_bytes() == data and not partial.exists()


def test_a_corrupted_blob_is_refused_and_removed(url, registry, store):
    data = gguf(3)
    digest = registry.add("library", "bad", "latest", {"model": data})["model"]
    registry.corrupt.add(digest)
    progress = lines(pull(url, "bad"))
    assert "error" in progress[-1] and "corrupt" in progress[-1]["error"] and digest in progress[-1]["error"]
    assert not list((store / "blobs").glob(f"{digest.replace(':', '-')}*"))
    assert "bad:latest" not in listed(url)
    r = pull(url, "bad", stream=False)
    assert r.status_code == 502 and "corrupt" in r.json()["error"]


@pytest.mark.parametrize("name,status,says", [
    ("no-such-model", 404, "no such model or tag"),
    ("tiny:no-such-tag", 404, "no such model or tag"),
    ("../../etc", 400, "invalid model name"),
])
def test_a_name_the_registry_does_not_have_is_a_clear_error(url, name, status, says):
    for stream in (True, False):
        r = pull(url, name, stream=stream)
        assert r.status_code == status and says in r.json()["error"], r.text


def test_pebbling_pull_shows_progress_on_stderr(registry, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    monkeypatch.setenv("PEBBLING_REGISTRY", registry.url)
    digest = registry.add("library", "cli", "latest", {"model": gguf(4)})["model"]
    assert main(["pull", "cli"]) == 0
    err = capsys.readouterr().err
    assert "pulling manifest" in err and "writing manifest" in err and "success" in err
    assert blob(tmp_path, digest).read_bytes() == registry.blobs[digest]
    assert main(["pull", "nothing-here"]) == 1
    assert "no such model or tag" in capsys.readouterr().err

"""Model management over HTTP, as Ollama's API does it: blobs uploaded by digest (streamed to disk,
verified), models created from an uploaded GGUF or an existing model with Modelfile layers, copied,
deleted, all in Ollama's store layout; push refused; every bad request a 4xx that says what was wrong."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import time

import pytest
import requests

from helpers import tiny_path
from pyplugin.serving import ollama_store
from server_patch import create_app
from server_patch.local import serving

BODY_LIMIT = 16 << 10  # far below a GGUF's size: uploads must not be bound by it


@pytest.fixture(scope="module")
def gguf():
    return tiny_path("qwen2").read_bytes()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("ollama")


@pytest.fixture(scope="module")
def url(store, tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_path("llama"), models / "local.gguf")
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(store))
    with serving(create_app(models_dir=models, max_body_bytes=BODY_LIMIT)) as url:
        yield url
    patch.undo()


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def upload(url, data: bytes, digest: str | None = None) -> requests.Response:
    return requests.post(f"{url}/api/blobs/{digest or digest_of(data)}", data=data, timeout=60)


def names(url) -> set[str]:
    return {m["name"] for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]}


def create(url, **body) -> requests.Response:
    return requests.post(f"{url}/api/create", json={"stream": False, **body}, timeout=60)


def manifest(store, name: str) -> dict:
    parsed = ollama_store.parse_name(name)
    return json.loads((store / "manifests" / parsed.host / parsed.namespace / parsed.model / parsed.tag).read_text())


def test_a_blob_upload_is_streamed_past_the_body_limit_and_verified(url, store, gguf):
    assert len(gguf) > 4 * BODY_LIMIT
    digest = digest_of(gguf)
    assert requests.head(f"{url}/api/blobs/{digest}", timeout=30).status_code == 404
    # Sent in pieces, without a length: the server hashes and writes each as it comes.
    r = requests.post(f"{url}/api/blobs/{digest}", data=(gguf[i:i + 5000] for i in range(0, len(gguf), 5000)),
                      timeout=60)
    assert r.status_code == 201, r.text
    assert requests.head(f"{url}/api/blobs/{digest}", timeout=30).status_code == 200
    assert (store / "blobs" / f"sha256-{digest[7:]}").read_bytes() == gguf
    # The JSON routes keep their limit.
    big = requests.post(f"{url}/api/show", json={"model": "x" * BODY_LIMIT}, timeout=30)
    assert big.status_code == 413


def test_a_blob_whose_bytes_do_not_match_its_digest_is_refused_and_removed(url, store, gguf):
    wrong = digest_of(b"something else")
    r = upload(url, gguf, wrong)
    assert r.status_code == 400 and "not to the digest" in r.json()["error"] and wrong in r.json()["error"]
    assert requests.head(f"{url}/api/blobs/{wrong}", timeout=30).status_code == 404
    assert not [p.name for p in (store / "blobs").iterdir() if wrong[7:] in p.name]


@pytest.mark.parametrize("digest", ["sha256:abc", "md5:" + "0" * 32, "sha256:" + "G" * 64, "..%2F..%2Fetc"])
def test_a_malformed_digest_is_a_400_that_shows_the_form(url, digest):
    r = requests.post(f"{url}/api/blobs/{digest}", data=b"x", timeout=30)
    assert r.status_code in (400, 404) and "error" in r.json()
    if r.status_code == 400:
        assert "sha256:<64 lowercase hex digits>" in r.json()["error"]


def test_create_from_an_uploaded_gguf_with_modelfile_layers(url, store, gguf):
    assert upload(url, gguf).status_code == 201
    r = create(url, model="mario", files={"mario.gguf": digest_of(gguf)}, template="{{ .Prompt }}",
               system="You are Mario.", parameters={"temperature": 0, "num_predict": 2, "stop": ["a", "b"]},
               messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "It's-a me!"}],
               license=["MIT", "Be kind."])
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    assert "mario:latest" in names(url)
    layers = {layer["mediaType"].rsplit(".", 1)[1]: layer for layer in manifest(store, "mario")["layers"]}
    assert layers["model"]["digest"] == digest_of(gguf) and layers["model"]["size"] == len(gguf)
    show = requests.post(f"{url}/api/show", json={"model": "mario"}, timeout=30).json()
    assert show["template"] == "{{ .Prompt }}" and show["system"] == "You are Mario."
    assert show["parameters"].splitlines() == ["temperature     0", "num_predict     2", 'stop            "a"',
                                               'stop            "b"']
    assert show["license"] == "MIT\nBe kind."
    assert 'MESSAGE assistant "It\'s-a me!"' in show["modelfile"]
    chat = requests.post(f"{url}/api/chat", json={"model": "mario", "stream": False,
                                                  "messages": [{"role": "user", "content": "Who?"}]}, timeout=60)
    assert chat.status_code == 200 and chat.json()["eval_count"] <= 2


def test_create_streams_ollamas_progress(url, gguf):
    upload(url, gguf)
    r = requests.post(f"{url}/api/create", json={"model": "me/streamed:v1", "files": {"m.gguf": digest_of(gguf)},
                                                 "system": "Hello."}, timeout=60)
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert r.headers["content-type"].startswith("application/x-ndjson")
    statuses = [line["status"] for line in lines]
    assert statuses[0] == "parsing GGUF" and statuses[-2:] == ["writing manifest", "success"]
    assert any(s.startswith("creating new layer sha256:") for s in statuses)
    assert "me/streamed:v1" in names(url)


def test_create_from_an_existing_model_keeps_its_layers_and_replaces_the_given_ones(url, store, gguf):
    upload(url, gguf)
    assert create(url, model="base", files={"b.gguf": digest_of(gguf)}, system="Base system.",
                  template="{{ .Prompt }}!", parameters={"temperature": 0.5, "top_k": 7}).status_code == 200
    r = create(url, model="derived:v2", **{"from": "base"}, system="Derived system.", parameters={"top_k": 3})
    assert r.status_code == 200, r.text
    show = requests.post(f"{url}/api/show", json={"model": "derived:v2"}, timeout=30).json()
    assert show["system"] == "Derived system." and show["template"] == "{{ .Prompt }}!"
    assert show["parameters"].splitlines() == ["temperature     0.5", "top_k           3"]  # merged, as Ollama does
    # From a file of the models directory: imported into the store as a blob.
    r = create(url, model="imported", **{"from": "local"})
    assert r.status_code == 200, r.text
    model_layer = manifest(store, "imported")["layers"][0]
    assert model_layer["digest"] == digest_of(tiny_path("llama").read_bytes())
    assert "imported:latest" in names(url)


def test_copy_and_delete_reflect_in_the_list_and_prune_unused_blobs(url, store, gguf):
    upload(url, gguf)
    assert create(url, model="original", files={"o.gguf": digest_of(gguf)}, system="Only mine.").status_code == 200
    system_blob = next(layer["digest"] for layer in manifest(store, "original")["layers"]
                       if layer["mediaType"].endswith(".system"))
    r = requests.post(f"{url}/api/copy", json={"source": "original", "destination": "twins/twin:v1"}, timeout=30)
    assert r.status_code == 200, r.text
    assert {"original:latest", "twins/twin:v1"} <= names(url)
    assert requests.delete(f"{url}/api/delete", json={"model": "original"}, timeout=30).status_code == 200
    assert "original:latest" not in names(url) and "twins/twin:v1" in names(url)
    assert (store / "blobs" / system_blob.replace(":", "-")).is_file()  # the twin still names it
    assert requests.delete(f"{url}/api/delete", json={"model": "twins/twin:v1"}, timeout=30).status_code == 200
    assert not (store / "blobs" / system_blob.replace(":", "-")).exists()
    assert not (store / "manifests" / "registry.ollama.ai" / "twins").exists()
    again = requests.delete(f"{url}/api/delete", json={"model": "original"}, timeout=30)
    assert again.status_code == 404 and "original" in again.json()["error"]


@pytest.mark.parametrize("body,status,says", [
    ({"model": "x"}, 400, "either 'files'"),
    ({"model": "x", "files": {"a.gguf": "sha256:" + "1" * 64}}, 400, "upload it first"),
    ({"model": "x", "files": {"a.gguf": "nope"}}, 400, "invalid digest"),
    ({"model": "x", "files": {"a.safetensors": "sha256:" + "1" * 64}}, 400, "one GGUF file"),
    ({"model": "x", "from": "no-such-model"}, 404, "not found"),
    ({"model": "../x", "from": "local"}, 400, "invalid model name"),
    ({"model": "x", "from": "local", "quantize": "q4_K_M"}, 400, "'quantize'"),
    ({"model": "x", "from": "local", "parameters": {"bogus": 1}}, 400, "'bogus' is not an option"),
    ({"model": "x", "from": "local", "parameters": {"temperature": "hot"}}, 400, "temperature"),
    ({"model": "x", "from": "local", "template": "{{ .Prompt "}, 400, "'template'"),
    ({"model": "x", "from": "local", "messages": [{"role": "robot"}]}, 400, "'messages'"),
    ({"model": "x", "modelfile": "FROM local"}, 400, "'modelfile'"),
    ({"model": "local", "from": "pebbling-demo"}, 400, "would hide"),
])
def test_bad_create_requests_say_what_was_wrong(url, body, status, says):
    r = create(url, **body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]
    assert "x:latest" not in names(url)


def test_a_file_that_is_not_a_gguf_is_refused(url):
    data = b"not a model at all" * 100
    assert upload(url, data).status_code == 201
    r = create(url, model="x", files={"x.gguf": digest_of(data)})
    assert r.status_code == 400 and "not a GGUF file" in r.json()["error"]


@pytest.mark.parametrize("path,body,status,says", [
    ("copy", {"source": "nope", "destination": "y"}, 404, "not found"),
    ("copy", {"source": "local", "destination": "../../etc/y"}, 400, "invalid model name"),
    ("copy", {"source": "local", "destination": "pebbling-demo"}, 400, "would hide"),
    ("delete", {"model": "local"}, 400, "remove the file yourself"),
    ("delete", {"model": "a/../../b"}, 400, "invalid model name"),
    ("delete", {}, 400, "'model' is required"),
    ("push", {"model": "local"}, 501, "not implemented"),
])
def test_copy_delete_and_push_refusals(url, path, body, status, says):
    method = requests.delete if path == "delete" else requests.post
    r = method(f"{url}/api/{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]


def test_an_upload_the_client_abandons_leaves_nothing_behind(url, store, gguf):
    host, port = url.removeprefix("http://").split(":")
    digest = digest_of(gguf + b"abandoned")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(gguf)}\r\n\r\n"
                     .encode() + gguf[:len(gguf) // 3])
        deadline, uploading = time.monotonic() + 10, f"sha256-{digest[7:]}.pebbling-upload-*"
        while not list((store / "blobs").glob(uploading)) and time.monotonic() < deadline:
            time.sleep(0.02)  # until the server has started writing it
        assert list((store / "blobs").glob(uploading)), "the upload never started"
    deadline = time.monotonic() + 10
    while list((store / "blobs").glob(f"sha256-{digest[7:]}*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list((store / "blobs").glob(f"sha256-{digest[7:]}*"))
    assert requests.head(f"{url}/api/blobs/{digest}", timeout=30).status_code == 404


def test_a_slow_upload_is_timed_from_its_last_bytes_not_its_first(store, gguf, tmp_path):
    """The body deadline (here 0.5 s) bounds the wait for each piece of a blob, not the whole upload, which
    may be gigabytes; a JSON body still has to arrive within it."""
    pieces = [gguf[i:i + len(gguf) // 4 + 1] for i in range(0, len(gguf), len(gguf) // 4 + 1)]

    def slowly(parts):
        for part in parts:
            time.sleep(0.3)
            yield part

    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(tmp_path))
    try:
        with serving(create_app(models_dir=tmp_path / "models"), body_timeout=0.5) as slow:
            r = requests.post(f"{slow}/api/blobs/{digest_of(gguf)}", data=slowly(pieces), timeout=30)
            assert r.status_code == 201, r.text
            assert (tmp_path / "blobs" / f"sha256-{digest_of(gguf)[7:]}").read_bytes() == gguf
            body = json.dumps({"model": "x"}).encode()
            with pytest.raises(requests.ConnectionError):
                requests.post(f"{slow}/api/show", data=slowly([body[:5], body[5:10], body[10:]]),
                              headers={"Content-Length": str(len(body))}, timeout=30)
    finally:
        patch.undo()


def test_delete_takes_its_json_body_as_curl_sends_it(url, gguf):
    upload(url, gguf)
    assert create(url, model="curled", files={"c.gguf": digest_of(gguf)}).status_code == 200
    r = requests.delete(f"{url}/api/delete", data=b'{"model": "curled"}',
                        headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 200, r.text
    assert "curled:latest" not in names(url)

"""Model management with the official `ollama` client, as its users call it: pull from a registry (served
on loopback), create from a GGUF file and from an existing model, copy, delete, with list reflecting
each step."""

from __future__ import annotations

import ollama
import pytest

from helpers import tiny_path
from registry import serving_registry
from server_patch import create_app
from server_patch.local import serving


@pytest.fixture(scope="module")
def registry():
    with serving_registry() as registry:
        yield registry


@pytest.fixture(scope="module")
def client(registry, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(tmp_path_factory.mktemp("ollama")))
    patch.setenv("PEBBLING_REGISTRY", registry.url)
    with serving(create_app(models_dir=tmp_path_factory.mktemp("models"))) as url:
        yield ollama.Client(host=url, timeout=120)
    patch.undo()


def names(client: ollama.Client) -> set[str]:
    return {m.model for m in client.list().models}


def test_pull_streams_progress_resumes_a_cut_and_refuses_a_corrupt_blob(client, registry):
    digest = registry.add("library", "smol", "q8", {"model": tiny_path("llama", seed=11).read_bytes(),
                                                     "system": b"Be short."})["model"]
    registry.cut[digest] = 1
    progress = list(client.pull("smol:q8", stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    mine = [p for p in progress if p.digest == digest]
    assert mine[-1].completed == mine[-1].total == len(registry.blobs[digest])
    assert registry.ranges(digest)[-1] == f"bytes={len(registry.blobs[digest]) // 2}-"  # resumed, not restarted
    assert "smol:q8" in names(client)
    assert 'SYSTEM """Be short."""' in client.show("smol:q8").modelfile
    reply = client.generate("smol:q8", "Hi", options={"num_predict": 2})
    assert reply.done and reply.eval_count <= 2

    bad = registry.add("library", "broken", "latest", {"model": tiny_path("llama", seed=12).read_bytes()})["model"]
    registry.corrupt.add(bad)
    with pytest.raises(ollama.ResponseError, match="corrupt"):
        list(client.pull("broken", stream=True))
    with pytest.raises(ollama.ResponseError, match="corrupt") as refused:
        client.pull("broken")
    assert refused.value.status_code == 502
    assert "broken:latest" not in names(client)
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("never-published")
    assert missing.value.status_code == 404


def test_create_from_a_file_and_a_model_then_copy_and_delete(client, tmp_path):
    path = tmp_path / "mine.gguf"
    path.write_bytes(tiny_path("qwen2", seed=21).read_bytes())
    digest = client.create_blob(path)
    assert digest.startswith("sha256:")
    statuses = [p.status for p in client.create(model="mine", files={"mine.gguf": digest}, system="You help.",
                                                parameters={"temperature": 0, "num_predict": 3}, stream=True)]
    assert statuses[0] == "parsing GGUF" and statuses[-1] == "success"
    assert "mine:latest" in names(client)
    shown = client.show("mine")
    assert 'SYSTEM """You help."""' in shown.modelfile and "num_predict     3" in shown.parameters

    done = client.create(model="mine-v2", from_="mine", template="{{ .Prompt }}", license="MIT",
                         messages=[{"role": "user", "content": "Ready?"}, {"role": "assistant", "content": "Yes."}])
    assert done.status == "success"
    derived = client.show("mine-v2")
    assert derived.template == "{{ .Prompt }}" and derived.license == "MIT"
    assert 'SYSTEM """You help."""' in derived.modelfile and 'MESSAGE assistant "Yes."' in derived.modelfile
    assert {"mine:latest", "mine-v2:latest"} <= names(client)
    chat = client.chat("mine-v2", messages=[{"role": "user", "content": "Go"}])
    assert chat.done and chat.eval_count == 3  # the parameters layer it inherited

    assert client.copy("mine-v2", "team/mine:stable").status == "success"
    assert "team/mine:stable" in names(client)
    assert client.show("team/mine:stable").template == "{{ .Prompt }}"
    assert client.delete("mine-v2").status == "success"
    assert "mine-v2:latest" not in names(client) and "team/mine:stable" in names(client)
    assert client.delete("team/mine:stable").status == "success"
    assert client.delete("mine").status == "success"
    assert not {"mine:latest", "team/mine:stable"} & names(client)
    with pytest.raises(ollama.ResponseError) as gone:
        client.delete("mine")
    assert gone.value.status_code == 404

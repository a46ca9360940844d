"""What `ollama list` and `ollama ps` users see of a model: one model has one ID wherever it is listed
(/api/tags, /api/ps, /api/show, `pebbling list` and `ps`), a model of Ollama's store the one `ollama list`
shows (the SHA-256 of its manifest); /api/ps gives the context_length in use, and `pebbling ps` a
PROCESSOR column as `ollama ps` does, from where the plan keeps the weights (an estimate)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil

import pytest
import requests

from helpers import tiny_path
from pyplugin.cli import main
from pyplugin.commands.models import processor
from pyplugin.runtime import Options, PebbledModel, PebblingOptions
from pyplugin.serving import ollama_store
from pyplugin.store import Strategy
from server_patch import create_app
from server_patch.local import serving

GREEDY = {"temperature": 0, "num_predict": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("ollama")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_path("llama"), root / "local.gguf")
    return root


@pytest.fixture(scope="module")
def url(store, models):
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(store))
    with serving(create_app(models_dir=models)) as url:
        yield url
    patch.undo()


@pytest.fixture
def env(url, store, models, monkeypatch):
    monkeypatch.setenv("PEBBLING_HOST", url)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    yield url
    for m in requests.get(f"{url}/api/ps", timeout=30).json()["models"]:  # the next test starts unloaded
        requests.post(f"{url}/api/generate", json={"model": m["name"], "keep_alive": 0}, timeout=30)


def tags(url) -> dict[str, dict]:
    return {m["name"]: m for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]}


def running(url) -> dict[str, dict]:
    return {m["name"]: m for m in requests.get(f"{url}/api/ps", timeout=30).json()["models"]}


def generate(url, model: str, **options) -> dict:
    r = requests.post(f"{url}/api/generate", json={"model": model, "prompt": "hi", "stream": False,
                                                    "options": {**GREEDY, **options}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def shown_ids(capsys, *args: str) -> dict[str, str]:
    """NAME -> ID of `pebbling list` or `ps` (the second column)."""
    assert main(list(args)) == 0
    lines = capsys.readouterr().out.splitlines()
    return {line.split()[0]: line.split()[1] for line in lines[1:]}


# ---------------------------------------------------------------------------------------------------
# one ID per model


def ids_everywhere(url, capsys, name: str) -> set[str]:
    """The model's ID as /api/tags, /api/show, /api/ps (after a generate), `pebbling list` and `pebbling ps`
    give it: 12 digits where the command line shows them, as Ollama's does."""
    listed = tags(url)[name]["digest"]
    shown = requests.post(f"{url}/api/show", json={"model": name}, timeout=30).json()["digest"]
    generate(url, name)
    loaded = running(url)[name]["digest"]
    assert len({listed, shown, loaded}) == 1 and len(listed) == 64
    return {listed[:12], shown_ids(capsys, "list")[name], shown_ids(capsys, "ps")[name]}


def test_a_file_of_the_models_directory_has_one_id_wherever_it_is_listed(env, capsys):
    assert len(ids_everywhere(env, capsys, "local:latest")) == 1


def test_a_model_of_ollamas_store_is_listed_by_its_manifests_digest_as_ollama_lists_it(env, store, capsys):
    copied = requests.post(f"{env}/api/copy", json={"source": "local", "destination": "kept"}, timeout=60)
    assert copied.status_code == 200
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "kept" / "latest"
    ollamas = hashlib.sha256(manifest.read_bytes()).hexdigest()  # what `ollama list` shows for it
    assert ids_everywhere(env, capsys, "kept:latest") == {ollamas[:12]}
    blob = ollama_store.resolve("kept").path.name
    assert blob != f"sha256-{ollamas}"  # the blob's digest is not the ID, as in Ollama


def test_a_file_changed_in_place_is_listed_with_another_id(env, models):
    before = tags(env)["local:latest"]["digest"]
    path = models / "local.gguf"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert tags(env)["local:latest"]["digest"] != before


# ---------------------------------------------------------------------------------------------------
# /api/ps and `pebbling ps` as Ollama's


def test_ps_gives_the_context_length_in_use(env):
    import ollama

    generate(env, "local", num_ctx=128)
    assert running(env)["local:latest"]["context_length"] == 128
    client = ollama.Client(host=env)
    assert [m.context_length for m in client.ps().models] == [128]  # the client showed None
    generate(env, "local", num_ctx=64)
    assert running(env)["local:latest"]["context_length"] == 64


def test_pebbling_ps_shows_processor_and_context_as_ollama_ps(env, capsys):
    generate(env, "local", num_ctx=96)
    assert main(["ps"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    row = out[1]
    assert row.startswith("local:latest") and "100% CPU" in row and " 96 " in row  # host memory: all CPU
    placement = running(env)["local:latest"]["pebbling"]
    assert placement["device_weight_bytes"] == 0 and placement["host_weight_bytes"] > 0
    assert placement["placement_how"].startswith("estimated")


def test_processor_is_the_share_of_the_weights_in_host_and_device_memory():
    def ps(device: int, host: int) -> dict:
        return {"pebbling": {"device_weight_bytes": device, "host_weight_bytes": host}, "size": 1, "size_vram": 1}

    assert processor(ps(0, 100)) == "100% CPU"
    assert processor(ps(100, 0)) == "100% GPU"
    assert processor(ps(52, 48)) == "48%/52% CPU/GPU"
    assert processor(ps(1, 2)) == "67%/33% CPU/GPU"
    # A server without pebbling's object (Ollama): its size and size_vram, as `ollama ps` reads them.
    assert processor({"size": 100, "size_vram": 25}) == "75%/25% CPU/GPU"
    assert processor({"size": 100, "size_vram": 0}) == "100% CPU"


def test_the_placement_follows_the_plans_resident_layers_where_arrays_are_on_a_device(tmp_path):
    from pyplugin.model import load_model
    from pyplugin.serving.loaded import Loaded

    model = load_model(tiny_path("llama", n_layer=4), progress=False)
    pebbled = PebbledModel(model, backend="stub")
    entry = Loaded(tmp_path / "tiny.gguf", "tiny", "quantized", model, pebbled)

    def placement(on_a_device: bool) -> tuple[int, int]:  # what /api/ps says; on_a_device: as cuda says of itself
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pebbled.backend, "arrays_on_device", on_a_device)
            shown = entry.running(max_context=4096).placement
        return shown["device_weight_bytes"], shown["host_weight_bytes"]

    assert placement(True) == (0, model.host_bytes)  # before a request: the layers are all in the host tier
    options = Options.from_dict({"num_predict": 1, "num_ctx": 64}, n_ctx_train=model.config.n_ctx_train)
    for strategy, resident in (("every:2", [0, 2]), ("none", [0, 1, 2, 3]), ("minimal", [])):
        pebbled.generation(options, PebblingOptions(Strategy.parse(strategy)), 3)
        plan = pebbled.plan_in_use
        assert list(plan.resident) == resident and entry.running(4096).context_length == 64
        layers, fixed = plan.memory.layer_weight_bytes, plan.memory.fixed_bytes
        on_device = sum(layers[i] for i in resident) + fixed
        assert placement(True) == (on_device, sum(layers) + fixed - on_device)
        assert placement(False) == (0, sum(layers) + fixed)  # host memory: all of it
    pebbled.close()

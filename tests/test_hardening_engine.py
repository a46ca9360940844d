"""The engine's side of the third hardening round (issue 44): two cached chats prefilled together in one
pass answer as each does alone; the catalogue keeps a bounded amount of model files' details and nothing of
a model deleted; keep_alive 0 unloads the copy that is loaded, in whatever weight form, loading nothing; a
server KV type that a model's heads cannot hold falls back to f16 for that model, and an unknown one stops
the server at start; a chat without messages only loads a model, whatever SYSTEM its Modelfile has."""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time

import numpy as np
import pytest
import requests

from helpers import store_backend_params, tiny_model, tiny_path
from pyplugin.cli import main as cli_main
from pyplugin.errors import OptionsError
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.batch import prefill_batch, prefills_together
from pyplugin.runtime.generation import Generation
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.runtime.store_layers import StoreLayers
from pyplugin.serving import Engine, GenerationRequest, batching, engine as engine_module
from pyplugin.serving import catalogue as catalogue_module
from pyplugin.serving.catalogue import Catalogue
from server_patch import create_app
from server_patch.local import serving

GREEDY = {"temperature": 0, "num_predict": 4}


def chat(url, model, content, **body):
    messages = [{"role": "user", "content": content}] if content is not None else []
    return requests.post(f"{url}/api/chat", json={"model": model, "stream": False, "options": GREEDY,
                                                  "messages": messages, **body}, timeout=60)


def running(url) -> list[dict]:
    return requests.get(f"{url}/api/ps", timeout=10).json()["models"]


# ---------------------------------------------------------------------------------------------------
# two cached prompts prefilled together: B sequences of one row each, not one sequence's chunk of B rows


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
def test_two_sequences_of_one_new_row_each_prefill_together_as_each_alone(backend):
    """Each prompt but its last token is in its sequence's cache (a conversation going on), so the pass
    holds one row of each: the attention is the one call for a token each, never a prompt chunk's."""
    model = tiny_model("qwen2", weights="quantized", n_layer=3, weight_type="Q8_0")
    options = Options(temperature=0, num_predict=4, num_ctx=64)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
    prompts = [[5, 17, 42, 8], [61, 7, 250, 12, 33]]
    pebbled = PebbledModel(model, backend=backend)
    source = StoreLayers(pebbled, pebbled.plan(options, pebbling, n_seqs=2), options, pebbling)
    gens = [Generation(model, options, layers=source.sequence(s)) for s in range(2)]
    for g, p in zip(gens, prompts):
        g.start(p[:-1])
    chunks = [g.begin(p, len(p) - 1) for g, p in zip(gens, prompts)]
    assert [len(c) for c in chunks] == [1, 1]
    assert prefills_together(source, gens) == (backend == "host")  # the engine takes this pass on the host
    got = prefill_batch(source, gens, chunks)
    for g, p, row in zip(gens, prompts, got):
        solo = PebbledModel(model, backend=backend).generation(options, pebbling, len(p))
        solo.start(p[:-1])
        np.testing.assert_array_equal(row, solo.prefill(p[-1:]))
        assert g.pos == len(p)


def queued(engine, n: int) -> None:
    """Waits until the one loaded model has n requests queued or running."""
    deadline = time.monotonic() + 10
    while engine.running()[0].active < n and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.mark.parametrize("backend", store_backend_params(("host",)))
def test_two_cached_chats_at_once_both_answer(tmp_path, backend, slow_tokens, monkeypatch):
    """Two chats whose prompts are cached, queued together behind a request of another plan, start in one
    prefill pass of a row each and answer what each answered alone (a 500 'too many values to unpack' once)."""
    shutil.copy(tiny_path("qwen2", n_layer=3, weight_type="Q8_0"), tmp_path / "tiny.gguf")
    passes = []
    real = batching.prefill_batch

    def counted(source, generations, chunks):
        passes.append([len(c) for c in chunks])
        return real(source, generations, chunks)

    monkeypatch.setattr(batching, "prefill_batch", counted)
    engine = Engine(tmp_path, backend=backend, num_parallel=4)
    try:
        with serving(create_app(engine)) as url:
            for _ in range(2):  # the second round runs from each conversation's cache, alone
                alone = {text: chat(url, "tiny", text).json() for text in ("Alpha one", "Beta two")}
            assert all(r["pebbling"]["cached_tokens"] > 0 for r in alone.values())
            blocker = threading.Thread(target=requests.post, args=(f"{url}/api/generate",), kwargs={"json": {
                "model": "tiny", "prompt": "wait", "raw": True, "stream": False,
                "options": {**GREEDY, "num_predict": 60, "pebbling_strategy": "none"}}, "timeout": 60})
            blocker.start()
            queued(engine, 1)  # first in the model's queue, so its plan runs first
            pair, replies = [], {}
            for text in alone:
                pair.append(threading.Thread(target=lambda t=text: replies.setdefault(t, chat(url, "tiny", t))))
                pair[-1].start()
            queued(engine, 3)
            assert blocker.is_alive(), "the pair was not queued while the other plan's request ran"
            for thread in [blocker, *pair]:
                thread.join(60)
    finally:
        engine.close()
    assert passes == [[1, 1]] and len(replies) == 2  # the two started together, a row each
    for text, reply in replies.items():
        assert reply.status_code == 200, reply.text[:300]
        assert reply.json()["message"]["content"] == alone[text]["message"]["content"]


# ---------------------------------------------------------------------------------------------------
# the catalogue's memory of model files


def test_the_catalogue_keeps_the_details_of_a_bounded_number_of_files(tmp_path):
    source, bound = tiny_path("llama"), catalogue_module.INFO_CACHE_ENTRIES
    catalogue = Catalogue(tmp_path)
    for n in range(bound + 20):
        path = tmp_path / f"m{n}.gguf"
        shutil.copy(source, path)
        assert catalogue.info(path)["size"] == source.stat().st_size
        assert catalogue.cached()[0] <= bound
    assert catalogue.cached()[0] == bound


def test_the_catalogue_keeps_a_bounded_number_of_bytes_and_one_entry_a_file(tmp_path):
    """Files of 4000 metadata strings (about 0.6 MB of details each) under a bound of 1 MiB: one is kept at
    a time; a file rewritten replaces its entry; a file larger than the bound is read but not kept."""
    catalogue = Catalogue(tmp_path, cache_bytes=1 << 20)
    shape = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=64)
    notes = {f"general.note_{i}": f"value {i} " + "x" * 20 for i in range(4000)}
    for n in range(3):
        write_gguf(tmp_path / f"big{n}.gguf", **shape, metadata=notes)
        assert len(catalogue.info(tmp_path / f"big{n}.gguf")["show"]["model_info"]) > 4000
        count, held = catalogue.cached()
        assert count == 1 and 400_000 < held <= 1 << 20
    write_gguf(tmp_path / "big2.gguf", **shape, metadata={**notes, "general.more": "y"})  # changed
    catalogue.info(tmp_path / "big2.gguf")
    assert catalogue.cached()[0] == 1
    write_gguf(tmp_path / "huge.gguf", **shape, metadata={f"general.note_{i}": "x" * 40 for i in range(8000)})
    assert catalogue.info(tmp_path / "huge.gguf")["size"] > 0
    count, held = catalogue.cached()
    assert count == 1 and held <= 1 << 20 and str((tmp_path / "huge.gguf").resolve()) not in catalogue._info_cache


def test_a_deleted_models_details_are_not_kept(tmp_path, monkeypatch):
    store, models = tmp_path / "ollama", tmp_path / "models"
    models.mkdir()
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    gguf = tiny_path("qwen2").read_bytes()
    digest = "sha256:" + hashlib.sha256(gguf).hexdigest()
    app = create_app(models_dir=models)
    catalogue = app.state.engine.catalogue
    with serving(app) as url:
        assert requests.post(f"{url}/api/blobs/{digest}", data=gguf, timeout=60).status_code == 201
        r = requests.post(f"{url}/api/create", json={"model": "brief", "files": {"m.gguf": digest}, "stream": False},
                          timeout=60)
        assert r.status_code == 200, r.text
        assert requests.post(f"{url}/api/show", json={"model": "brief"}, timeout=30).status_code == 200
        blob = str((store / "blobs" / digest.replace(":", "-")).resolve())
        assert any(blob in str(key) for key in catalogue._info_cache)
        assert requests.delete(f"{url}/api/delete", json={"model": "brief"}, timeout=30).status_code == 200
        assert not (store / "blobs" / digest.replace(":", "-")).exists()
        assert requests.get(f"{url}/api/tags", timeout=30).status_code == 200  # `ollama rm`, then `ollama ls`
        assert not any(blob in str(key) for key in catalogue._info_cache)


# ---------------------------------------------------------------------------------------------------
# keep_alive 0 and the weight forms


@pytest.fixture
def loads(monkeypatch) -> list:
    """The forms of every model file the engine loads from here on."""
    seen, real = [], engine_module.load_model

    def load_model(path, *, weights, **kwargs):
        seen.append(weights)
        return real(path, weights=weights, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", load_model)
    return seen


def _forms(engine) -> list[str]:
    return sorted(m.details["pebbling_weights"] for m in engine.running())


def test_keep_alive_zero_unloads_the_form_loaded_without_loading_another(tmp_path, loads):
    shutil.copy(tiny_path("llama", weight_type="Q8_0"), tmp_path / "tiny.gguf")
    engine = Engine(tmp_path, backend="stub")
    try:
        ask = {"model": "tiny", "prompt": "Hello", "options": {**GREEDY, "pebbling_weights": "f16"}}
        assert engine.submit(GenerationRequest(**ask)).result()[1].eval_count == 4
        assert _forms(engine) == ["f16"] and loads == ["f16"]
        # `pebbling stop` / `ollama stop`: the name and keep_alive 0, no options
        text, final = engine.submit(GenerationRequest("tiny", keep_alive=0)).result()
        assert (text, final.done_reason, final.load_duration) == ("", "unload", 0)
        assert _forms(engine) == [] and loads == ["f16"]
        # With both forms loaded, a request naming one unloads that one
        engine.submit(GenerationRequest(**ask)).result()
        engine.submit(GenerationRequest("tiny", prompt="Hello", options=GREEDY)).result()
        assert _forms(engine) == ["f16", "quantized"]
        engine.submit(GenerationRequest("tiny", keep_alive=0, options={"pebbling_weights": "quantized"})).result()
        assert _forms(engine) == ["f16"]
        # A request that generates with keep_alive 0 unloads the copy it used
        engine.submit(GenerationRequest(**ask, keep_alive=0)).result()
        assert _forms(engine) == [] and loads == ["f16", "f16", "quantized"]
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------
# the server's KV cache type


@pytest.fixture
def head_models(tmp_path):
    """head48: heads 48 wide, which no 32-element block divides; head32: heads of one block."""
    shape = dict(n_layer=2, n_head_kv=1, n_ff=128, n_ctx=256)
    write_gguf(tmp_path / "head48.gguf", n_embd=96, n_head=2, **shape)
    write_gguf(tmp_path / "head32.gguf", n_embd=64, n_head=2, **shape)
    return tmp_path


def test_a_server_kv_type_that_the_heads_cannot_hold_falls_back_to_f16_for_that_model(head_models, monkeypatch,
                                                                                      caplog):
    monkeypatch.setenv("PEBBLING_KV_CACHE_TYPE", "q4_0")
    engine = Engine(head_models, backend="stub")
    try:
        with caplog.at_level(logging.WARNING, logger="pebbling"):
            _, narrow = engine.submit(GenerationRequest("head48", prompt="Hello", options=GREEDY)).result()
        _, wide = engine.submit(GenerationRequest("head32", prompt="Hello", options=GREEDY)).result()
        with pytest.raises(OptionsError, match="multiple of 32"):  # asked for by name: refused, as before
            engine.submit(GenerationRequest("head48", prompt="Hello", options={"pebbling_kv_type": "q4_0"}))
    finally:
        engine.close()
    assert narrow.eval_count == 4 and narrow.report["kv_type"] == "f16"
    note = narrow.report["kv_type_fallback"]
    assert "PEBBLING_KV_CACHE_TYPE=q4_0" in note and "48" in note
    assert any("head48" in r.getMessage() and "q4_0" in r.getMessage() for r in caplog.records)
    assert wide.report["kv_type"] == "q4_0" and "kv_type_fallback" not in wide.report


def test_an_unknown_server_kv_type_stops_the_server_at_start(tmp_path, monkeypatch, capsys):
    import uvicorn

    monkeypatch.setenv("PEBBLING_KV_CACHE_TYPE", "bogus")
    started = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: started.append(a))
    for make in (lambda: Engine(tmp_path), lambda: create_app(models_dir=tmp_path)):
        with pytest.raises(OptionsError, match="PEBBLING_KV_CACHE_TYPE: got 'bogus'; accepted: f16, q8_0, q4_0"):
            make()
    assert cli_main(["serve", "--port", "1"]) == 1 and not started
    err = capsys.readouterr().err
    assert err.startswith("pebbling: error: ") and "'bogus'" in err and "q8_0" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------------
# a chat without messages


def test_a_chat_without_messages_only_loads_a_model_whose_modelfile_has_a_system(tmp_path, monkeypatch):
    """Ollama's rule is on the request's messages: none loads the model (keep_alive 0 unloads it) and
    answers an empty done response, whatever SYSTEM or MESSAGE turns the Modelfile adds."""
    store, models = tmp_path / "ollama", tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_path("llama"), models / "plain.gguf")
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    gguf = tiny_path("qwen2").read_bytes()
    digest = "sha256:" + hashlib.sha256(gguf).hexdigest()
    with serving(create_app(models_dir=models)) as url:
        assert requests.post(f"{url}/api/blobs/{digest}", data=gguf, timeout=60).status_code == 201
        r = requests.post(f"{url}/api/create", json={
            "model": "mario", "files": {"m.gguf": digest}, "system": "You are Mario.", "stream": False,
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "It's-a me!"}]},
            timeout=60)
        assert r.status_code == 200, r.text
        for model in ("mario", "plain"):
            loaded = chat(url, model, None)
            assert loaded.status_code == 200, loaded.text[:300]
            body = loaded.json()
            assert (body["done"], body["done_reason"], body["message"]["content"]) == (True, "load", "")
            assert body["eval_count"] == 0
            assert any(m["name"] == f"{model}:latest" for m in running(url))
            unloaded = chat(url, model, None, keep_alive=0).json()
            assert (unloaded["done_reason"], unloaded["message"]["content"]) == ("unload", "")
            assert not any(m["name"] == f"{model}:latest" for m in running(url))
        assert chat(url, "mario", "Who?").json()["eval_count"] == 4  # with messages it answers

"""Model names -> files, the demo model, and `pebbling run`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gguf import GGUFReader

from helpers import tiny_path
from pyplugin.serving import registry
from pyplugin.cli import main as cli_main
from pyplugin.errors import ModelError
from pyplugin.model import synth
from pyplugin.serving.registry import DEMO_NAME, resolve


@pytest.fixture
def models(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    return root


def test_an_existing_path_resolves_to_itself():
    path = tiny_path("llama")
    assert resolve(str(path)) == path and resolve(path) == path


def test_paths_can_be_refused_for_names_from_the_network(models):
    with pytest.raises(ModelError, match="not found"):
        resolve(str(tiny_path("llama")), models, allow_paths=False)


def test_names_in_the_models_directory(models):
    shutil.copy(tiny_path("llama"), models / "tiny.gguf")
    shutil.copy(tiny_path("qwen2"), models / "tiny:q8.gguf")
    assert resolve("tiny", models) == models / "tiny.gguf"
    assert resolve("tiny:latest", models) == models / "tiny.gguf"
    assert resolve("tiny:q8", models) == models / "tiny:q8.gguf"
    assert registry.available(models) == [DEMO_NAME, "tiny", "tiny:q8"]


def test_models_directory_from_the_environment(models, monkeypatch):
    shutil.copy(tiny_path("llama"), models / "envmodel.gguf")
    monkeypatch.setenv(registry.MODELS_ENV, str(models))
    assert resolve("envmodel") == models / "envmodel.gguf"


def test_unknown_name(models):
    with pytest.raises(ModelError, match="model 'nope' not found"):
        resolve("nope", models)


@pytest.mark.parametrize("name", ["../outside", "sub/inside", "..", "x/../outside", "/abs/outside"])
def test_names_that_could_be_paths_never_reach_the_models_directory(models, name, monkeypatch):
    shutil.copy(tiny_path("llama"), models.parent / "outside.gguf")
    (models / "sub").mkdir()
    shutil.copy(tiny_path("llama"), models / "sub" / "inside.gguf")
    looked, in_store = [], []
    monkeypatch.setattr(registry, "_in_models_dir", lambda *a: looked.append(a))
    monkeypatch.setattr(registry, "find_in_ollama_store", lambda *a: in_store.append(a))
    with pytest.raises(ModelError, match="not found"):
        resolve(name, models)
    assert looked == []
    # Only a name Ollama's rules accept (namespace/model) is looked up, as a manifest in its store.
    assert in_store == ([(name,)] if name == "sub/inside" else [])


def test_demo_is_written_once_deterministically_and_labelled(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    a = resolve(DEMO_NAME, tmp_path / "models")
    assert a == tmp_path / "cache" / f"{DEMO_NAME}.gguf"
    b = registry.ensure_demo(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    mtime = a.stat().st_mtime_ns
    assert resolve(DEMO_NAME, tmp_path / "models") == a and a.stat().st_mtime_ns == mtime
    fields = GGUFReader(a).fields
    assert "random weights" in fields["general.name"].contents()
    assert "RANDOM WEIGHTS" in fields["general.description"].contents()
    assert fields["llama.block_count"].contents() == 16
    assert not list(a.parent.glob(".*partial"))


# A small demo, slow to write, so that concurrent writers overlap: the threads of one server (its first
# concurrent requests for pebbling-demo) and processes sharing one cache (Ray replicas).
SMALL_DEMO = dict(registry.DEMO_SPEC, n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=256)


def slow_writes(write):
    def written_then_paused(path, **spec):
        write(path, **spec)
        time.sleep(0.5)  # written, not yet renamed: another writer is in the middle of its own
    return written_then_paused


def test_concurrent_writers_in_one_process_each_get_the_whole_demo(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "DEMO_SPEC", SMALL_DEMO)
    monkeypatch.setattr(synth, "write_gguf", slow_writes(synth.write_gguf))
    barrier, results = threading.Barrier(4), []

    def load():
        barrier.wait()
        try:
            results.append(GGUFReader(registry.ensure_demo(tmp_path)).fields["llama.block_count"].contents())
        except Exception as exc:  # writers once shared '.pebbling-demo.PID.partial': "No such file"
            results.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [2, 2, 2, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{DEMO_NAME}.gguf"]


def test_concurrent_writers_in_two_processes_each_get_the_whole_demo(tmp_path):
    script = ("import sys\nfrom pyplugin.model import synth\nfrom pyplugin.serving import registry\n"
              "from test_model_registry import SMALL_DEMO, slow_writes\n"
              "registry.DEMO_SPEC, synth.write_gguf = SMALL_DEMO, slow_writes(synth.write_gguf)\n"
              "print(registry.ensure_demo(sys.argv[1]).stat().st_size)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    writers = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outcomes = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], outcomes
    path = tmp_path / f"{DEMO_NAME}.gguf"
    assert [int(out) for out, _ in outcomes] == [path.stat().st_size] * 2
    assert GGUFReader(path).fields["llama.block_count"].contents() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_run_streams_text_and_flags_random_weights(capsys):
    path = tiny_path("llama")
    assert cli_main(["run", str(path), "hello", "--temperature", "0", "--num-predict", "5",
                     "--num-ctx", "128", "--num-batch", "4", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert "(random weights)" in err
    assert out.endswith("\n")


def test_run_raw_and_chat_differ(capsys):
    path = str(tiny_path("llama"))
    cli_main(["run", path, "hello", "--temperature", "0", "--num-predict", "6"])
    chat = capsys.readouterr().out
    cli_main(["run", path, "hello", "--temperature", "0", "--num-predict", "6", "--raw"])
    raw = capsys.readouterr().out
    assert chat != raw


def test_run_reports_bad_options(capsys):
    assert cli_main(["run", str(tiny_path("llama")), "hi", "--num-ctx", "0"]) == 1
    assert "--num-ctx 0" in capsys.readouterr().err

"""What a new user trips over first: a closed pipe, a path that is not there or not a GGUF file, an
unknown name, `run` without arguments, a spelled-out keep-alive, `show --system` on a model with no
system message, a cuda backend that was never built, a server that says what it serves, a models
directory left as it was, and `make serve` without the test tools."""

from __future__ import annotations

import datetime
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

import pyplugin
from helpers import free_port
from pyplugin.cli import main
from pyplugin.model.synth import write_gguf
from pyplugin.serving import registry
from pyplugin.serving.jobs import parse_keep_alive, spelled_duration
from pyplugin.store import probe
from server_patch import create_app
from server_patch.local import serving

ROOT = Path(pyplugin.__file__).resolve().parents[1]
TINY = dict(arch="llama", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=512)
GREEDY = ["--temperature", "0", "--num-predict", "4"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    return root


@pytest.fixture(scope="module")
def server(models_dir):
    with serving(create_app(models_dir=models_dir)) as url:
        yield url


@pytest.fixture(autouse=True)
def environment(models_dir, tmp_path, monkeypatch):
    """In-process runs (nothing answers on $PEBBLING_HOST), this models directory, an empty Ollama
    store and an empty stdin."""
    monkeypatch.setenv("PEBBLING_HOST", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("PEBBLING_MODELS", str(models_dir))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama-store"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))


def cli(*args: str) -> int:
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code


def command_into_closed_pipe(*args: str, host: str | None = None) -> subprocess.CompletedProcess:
    """`pebbling ARGS | head -0`: the reader closes the pipe before the command writes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if host:
        env["PEBBLING_HOST"] = host
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        return subprocess.run([sys.executable, "-m", "pyplugin.cli", *args], stdout=write, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, env=env, timeout=120)
    finally:
        os.close(write)


# ---------------------------------------------------------------------------------------------------
# a broken pipe


@pytest.mark.parametrize("args", [["list"], ["show", "tiny"], ["run", "tiny", "hello", *GREEDY]],
                         ids=["list", "show", "run-through-server"])
def test_a_closed_pipe_ends_quietly_through_the_server(args, server):
    done = command_into_closed_pipe(*args, host=server)
    assert done.returncode == 141, done.stderr  # as a shell reports a command ended by SIGPIPE
    assert noted(done.stderr) == []


def test_a_closed_pipe_ends_quietly_in_process():
    done = command_into_closed_pipe("run", "tiny", "hello", *GREEDY)
    assert done.returncode == 141, done.stderr
    assert noted(done.stderr) == []


def noted(stderr: str) -> list[str]:
    """What stderr says beside run's note that the tiny model's weights are random."""
    return [line for line in stderr.splitlines() if not line.startswith("(random weights)")]


# ---------------------------------------------------------------------------------------------------
# paths and names


def test_a_missing_file_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "model.gguf"
    assert cli("run", str(missing), "hi") == 1
    err = capsys.readouterr().err
    assert f"model file {missing} does not exist" in err
    assert "path separators" not in err and "invalid model name" not in err


def test_a_missing_file_is_not_sent_to_a_running_server(tmp_path, server, monkeypatch, capsys):
    monkeypatch.setenv("PEBBLING_HOST", server)
    assert cli("run", "./not-here.gguf", "hi") == 1
    err = capsys.readouterr().err
    assert "model file ./not-here.gguf does not exist" in err and "path separators" not in err


def test_a_directory_is_not_a_model_file(tmp_path, capsys):
    assert cli("run", str(tmp_path), "hi") == 1
    assert f"model file {tmp_path} is a directory, not a GGUF file" in capsys.readouterr().err


def test_a_file_that_is_not_gguf_is_named_by_its_path(tmp_path, capsys):
    bogus = tmp_path / "notgguf.gguf"
    bogus.write_text("not a model")
    assert cli("run", str(bogus), "hi") == 1
    err = capsys.readouterr().err
    assert f"'{bogus}': not a GGUF file" in err
    assert "the models directory" not in err


def test_an_unknown_name_says_where_run_looked(models_dir, tmp_path, capsys):
    assert cli("run", "llama3", "hi") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pebbling: error: model 'llama3' not found")
    assert str(models_dir) in err and "$PEBBLING_MODELS" in err and "Ollama's local store" in err
    assert cli("run", "me/llama3", "hi") == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "no-ollama-store") in err and "no such file" not in err


def test_an_unknown_name_through_the_server_says_which_server_and_how_to_list(server, monkeypatch, capsys):
    monkeypatch.setenv("PEBBLING_HOST", server)
    assert cli("run", "llama3", "hi") == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"pebbling: error: model 'llama3' not found by the server at {server} (pebbling list shows the "
                   "models it serves)")


def test_run_without_arguments_asks_for_the_model_only(capsys):
    assert cli("run") == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: model" in err
    assert "prompt" not in err.splitlines()[-1]


# ---------------------------------------------------------------------------------------------------
# flags


@pytest.mark.parametrize("text, go", [("5 minutes", "5m"), ("1 hour 30 min", "1h30m"), ("1h 30m", "1h30m"),
                                      ("10 seconds", "10s"), ("2 secs", "2s"), ("300 milliseconds", "300ms"),
                                      ("1 hr", "1h"), ("5m", "5m"), ("90", "90"), ("-1", "-1")])
def test_spelled_out_durations_become_go_durations(text, go):
    assert spelled_duration(text) == go


@pytest.mark.parametrize("text", ["soon", "5 parsecs", "5 minutes ago", "1h30", "minutes"])
def test_keepalive_still_refuses_what_is_no_duration(text, capsys):
    assert cli("run", "tiny", "hi", "--keepalive", text) == 1
    assert f"--keepalive '{text}': not a duration; accepted:" in capsys.readouterr().err


def test_the_api_keeps_ollamas_durations_only():  # as Ollama's API: "10 minutes" is a 400 there
    with pytest.raises(pyplugin.errors.OptionsError, match="keep_alive"):
        parse_keep_alive("10 minutes")


def test_run_takes_keepalive_in_words(server, monkeypatch, capsys):
    assert cli("run", "tiny", "hi", *GREEDY, "--keepalive", "5 minutes") == 0
    assert noted(capsys.readouterr().err) == []
    monkeypatch.setenv("PEBBLING_HOST", server)  # sent as the Go duration the server takes
    assert cli("run", "tiny", "hi", *GREEDY, "--keepalive", "2 minutes") == 0
    (running,) = requests.get(f"{server}/api/ps", timeout=30).json()["models"]
    left = datetime.datetime.fromisoformat(running["expires_at"].replace("Z", "+00:00")) - \
        datetime.datetime.now(datetime.timezone.utc)
    assert 60 < left.total_seconds() <= 120
    requests.post(f"{server}/api/generate", json={"model": "tiny", "keep_alive": 0}, timeout=30)


def test_show_system_of_a_model_without_one_is_blank(server, monkeypatch, capsys):
    monkeypatch.setenv("PEBBLING_HOST", server)
    for field in ("--system", "--parameters", "--license"):
        assert cli("show", "tiny", field) == 0, field
        assert capsys.readouterr().out == "\n"


def test_a_cuda_library_that_is_missing_says_how_to_build_it(tmp_path):
    found = probe_with_library("cuda", tmp_path / "libpebble_cuda.so")
    assert not found.usable
    assert "no such file" in found.reason and "make cuda" in found.reason


def test_why_cuda_was_passed_over_is_one_short_line_with_the_cause_as_this_machine_has_it(tmp_path, monkeypatch):
    """What a server start logs about cuda: the cause in a line, and a hint true of this machine (with nvcc on
    PATH, not "install where nvcc is on PATH"); the whole story stays in the probe's detail (pebbling info)."""
    import pyplugin.store.backend as backend_module

    for nvcc, hint in (("/opt/cuda/bin/nvcc", "nvcc is on PATH: `make cuda` builds it"),
                       (None, "`make cuda` builds it where the CUDA toolkit (nvcc) is installed")):
        monkeypatch.setattr(backend_module.shutil, "which", lambda name, nvcc=nvcc: nvcc if name == "nvcc" else None)
        found = probe_with_library("cuda", tmp_path / nvcc_dir(nvcc) / "libpebble_cuda.so")
        assert found.reason == f"no such file: libpebble_cuda.so; {hint}"
        assert "no usable cuda pebble library" in found.detail and "\n" not in found.reason
    # a library that loads where no driver is: the CUDA runtime's words, not its call or source line
    assert backend_module._cuda_cause("pebble_init: cudaSetDevice(device) failed: CUDA driver version is "
                                      "insufficient for CUDA runtime version (native/store.cu:111)") == \
        "CUDA driver version is insufficient for CUDA runtime version"


def nvcc_dir(nvcc) -> str:
    return "with-nvcc" if nvcc else "without-nvcc"  # a path of its own: probes are cached per PEBBLING_LIB


def test_backend_cuda_without_a_library_mentions_make_cuda(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PEBBLING_LIB", str(tmp_path / "libpebble_cuda.so"))  # no library, whatever build/ holds
    assert cli("run", "tiny", "hi", *GREEDY, "--backend", "cuda") == 1
    assert "make cuda" in capsys.readouterr().err


@pytest.mark.parametrize("name, value", [("PEBBLING_CUDA_GROUP", "9"), ("PEBBLING_CUDA_STACK", "off"),
                                         ("PEBBLING_CUDA_MATVEC", "fp16"), ("PEBBLING_CUDA_GRAPHS", "yes")])
def test_a_switch_set_to_a_value_it_does_not_take_is_refused_naming_what_it_takes(name, value, monkeypatch, capsys):
    """The library would take the value as its default: the command says so instead, before it runs."""
    monkeypatch.setenv(name, value)
    assert cli("run", "tiny", "hi", *GREEDY) == 1
    err = capsys.readouterr().err
    assert f"{name}={value!r}" in err and "accepted:" in err


def probe_with_library(kind: str, path: Path):
    old = os.environ.get("PEBBLING_LIB")
    os.environ["PEBBLING_LIB"] = str(path)
    try:
        return probe(kind)
    finally:
        if old is None:
            del os.environ["PEBBLING_LIB"]
        else:
            os.environ["PEBBLING_LIB"] = old


# ---------------------------------------------------------------------------------------------------
# serve


def test_the_server_says_its_backend_and_models_when_it_starts_and_stops_cleanly(models_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "pyplugin.cli", "serve", "--port", str(free_port()),
                               "--models", str(models_dir)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              text=True, env=env)
    said = []
    try:
        for line in server.stderr:  # up to uvicorn's own start-up lines
            said.append(line)
            if "Uvicorn running" in line or len(said) > 50:
                break
    finally:
        server.terminate()
        server.wait(timeout=30)
    # a SIGTERM is a clean stop: status 0, so `make serve` stopped so prints no make error
    assert server.returncode == 0, server.returncode
    said = "".join(said)
    backend = pyplugin.store.choose_backend().backend.name
    assert f"store backend {backend}: " in said  # the choice and why
    assert (f"store backend {backend}; models directory {models_dir}; serving 2 model(s): "
            "pebbling-demo:latest, tiny:latest") in said


def test_serving_a_directory_never_writes_the_demo_into_it(tmp_path, monkeypatch):
    users = tmp_path / "my-models"
    users.mkdir()
    write_gguf(users / "mine.gguf", **TINY)
    before = sorted(p.name for p in users.iterdir())
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    with serving(create_app(models_dir=users)) as url:
        names = {m["name"] for m in requests.get(f"{url}/api/tags", timeout=60).json()["models"]}
        r = requests.post(f"{url}/api/generate", json={"model": "pebbling-demo", "prompt": "hi", "stream": False,
                                                       "options": {"num_predict": 1}}, timeout=120)
    assert r.status_code == 200, r.text
    assert {"mine:latest", "pebbling-demo:latest"} <= names
    assert sorted(p.name for p in users.iterdir()) == before
    assert (tmp_path / "cache" / "pebbling-demo.gguf").is_file()


def test_make_serve_installs_without_the_test_extra(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make is not installed")

    def planned(target: str) -> list[str]:
        done = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if "pip install" in line]

    serve = planned("serve")
    assert any(line.endswith("install --quiet -e .") for line in serve), serve
    # a cold `make serve` says what it compiles, and for about how long, before it starts
    said = subprocess.run(["make", "-n", "-B", "serve", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout
    assert "building the host library, build/libpebble_host.so, on" in said and "(about half a minute on 2)" in said
    assert not any("[test]" in line for line in serve)
    assert any("-e '.[test]'" in line for line in planned("venv"))

"""The command line as Ollama's users use it (issue 47), through the installed `pebbling` command:
one models directory for the server and every command (the ./models that `make serve` fills is found by
`estimate`, `verify` and `run` as by `serve`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from helpers import free_port
from pyplugin.model.synth import write_gguf

TINY = dict(arch="llama", n_layer=4, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=4096)
PEBBLING = Path(sys.executable).with_name("pebbling")  # the console script the package installs


def pebbling(*args: str, cwd: Path, env: dict[str, str], input: str | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess:
    assert PEBBLING.is_file(), f"the pebbling command is not installed beside {sys.executable}"
    return subprocess.run([str(PEBBLING), *args], cwd=cwd, env=env, input=input, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def project(tmp_path) -> Path:
    """A directory as `make serve` leaves it: ./models holding smollm2:135m (a tiny stand-in)."""
    root = tmp_path / "project"
    (root / "models").mkdir(parents=True)
    write_gguf(root / "models" / "smollm2:135m.gguf", **TINY)
    return root


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    """A user's environment with nothing set for pebbling: no $PEBBLING_MODELS, a home of its own, an empty
    Ollama store, and no server where the commands would look for one."""
    env = {k: v for k, v in os.environ.items() if k not in ("PEBBLING_MODELS", "PEBBLING_HOST")}
    (tmp_path / "home").mkdir()
    (tmp_path / "ollama").mkdir()
    env.update(HOME=str(tmp_path / "home"), OLLAMA_MODELS=str(tmp_path / "ollama"),
               PEBBLING_HOST=f"127.0.0.1:{free_port()}")
    return env


# ---------------------------------------------------------------------------------------------------
# one models directory


@pytest.mark.parametrize("command", [["estimate", "smollm2:135m"],
                                     ["verify", "smollm2:135m", "--num-predict", "2"],
                                     ["run", "smollm2:135m", "hello", "--num-predict", "3", "--temperature", "0"]])
def test_offline_commands_find_the_model_make_serve_serves(command, project, user_env):
    done = pebbling(*command, cwd=project, env=user_env)
    assert done.returncode == 0, done.stderr
    assert "not found" not in done.stderr and done.stdout.strip()


def test_serve_without_models_serves_the_directory_the_commands_read(project, user_env):
    port = free_port()
    env = {**user_env, "PEBBLING_HOST": f"127.0.0.1:{port}"}
    with open(project / "serve.log", "w+") as log:
        server = subprocess.Popen([str(PEBBLING), "serve", "--log-level", "warning"], cwd=project, env=env,
                                  stdout=subprocess.DEVNULL, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    tags = requests.get(f"{url}/api/tags", timeout=5).json()["models"]
                    break
                except requests.ConnectionError:
                    assert server.poll() is None and time.monotonic() < deadline, log.read()
                    time.sleep(0.2)
            assert "smollm2:135m" in {m["name"] for m in tags}
            # run goes to that server, which serves the same file
            done = pebbling("run", "smollm2:135m", "hello", "--num-predict", "3", "--temperature", "0",
                            cwd=project, env=env)
            assert done.returncode == 0, done.stderr
            assert [m["name"] for m in requests.get(f"{url}/api/ps", timeout=30).json()["models"]] == ["smollm2:135m"]
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_pebbling_models_wins_and_elsewhere_the_cache_is_the_models_directory(project, user_env, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    done = pebbling("estimate", "smollm2:135m", cwd=project, env={**user_env, "PEBBLING_MODELS": str(other)})
    assert done.returncode == 1 and f"not in {other}" in done.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = pebbling("estimate", "smollm2:135m", cwd=elsewhere, env=user_env)
    cache = Path(user_env["HOME"]) / ".cache" / "pebbling" / "models"
    assert done.returncode == 1 and f"not in {cache}" in done.stderr
    cache.mkdir(parents=True)
    (project / "models" / "smollm2:135m.gguf").rename(cache / "smollm2:135m.gguf")
    done = pebbling("estimate", "smollm2:135m", cwd=elsewhere, env=user_env)
    assert done.returncode == 0, done.stderr

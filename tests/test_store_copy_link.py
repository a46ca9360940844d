"""/api/copy (and /api/create from) a file of the models directory: a read-only file is hard-linked into
Ollama's store where the file system allows, a writable one copied (a link would let an edit of the file
change the store's blob behind its digest), and the log says which and why."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil

import pytest
import requests

from helpers import tiny_path
from pyplugin.serving import ollama_store
from server_patch import create_app
from server_patch.local import serving


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_path("llama"), root / "local.gguf")
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory, models):
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(tmp_path_factory.mktemp("ollama")))
    with serving(create_app(models_dir=models)) as url:
        yield url
    patch.undo()


def generate(url, model: str) -> dict:
    r = requests.post(f"{url}/api/generate", json={"model": model, "prompt": "hi", "stream": False,
                                                    "options": {"temperature": 0, "num_predict": 2}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def running(url) -> dict[str, dict]:
    return {m["name"]: m for m in requests.get(f"{url}/api/ps", timeout=30).json()["models"]}



def copy(url, source: str, destination: str) -> None:
    r = requests.post(f"{url}/api/copy", json={"source": source, "destination": destination}, timeout=60)
    assert r.status_code == 200 and r.text == "", r.text  # Ollama's answer: an empty 200


def blob_of(name: str):
    found = ollama_store.resolve(name)
    assert found.path.name == "sha256-" + hashlib.sha256(found.path.read_bytes()).hexdigest()  # the digest holds
    return found.path


def said(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("model store:"))


def test_a_read_only_file_is_linked_into_the_store_not_copied(env, models, caplog):
    frozen = models / "frozen.gguf"
    shutil.copy(tiny_path("llama", seed=5), frozen)
    frozen.chmod(0o444)
    with caplog.at_level(logging.INFO, logger="pebbling"):
        copy(env, "frozen", "linked")
    blob = blob_of("linked")
    assert os.path.samefile(blob, frozen) and frozen.stat().st_nlink == 2  # one file, no second copy
    assert "linked frozen.gguf into blob sha256:" in said(caplog) and "no copy" in said(caplog)
    assert generate(env, "linked")["done"]
    requests.delete(f"{env}/api/delete", json={"model": "linked"}, timeout=60).raise_for_status()
    assert not blob.exists() and frozen.stat().st_nlink == 1 and generate(env, "frozen")["done"]
    assert "linked:latest" in running(env)  # still loaded, its file gone: /api/ps shows what was loaded


def test_a_writable_file_is_copied_and_the_log_says_why(env, models, caplog):
    with caplog.at_level(logging.INFO, logger="pebbling"):
        copy(env, "local", "copied")
    assert not os.path.samefile(blob_of("copied"), models / "local.gguf")
    assert "copied local.gguf into blob sha256:" in said(caplog) and "it is writable" in said(caplog)


def test_where_the_file_system_refuses_a_link_the_file_is_copied(env, models, caplog, monkeypatch):
    def cross_device(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    frozen = models / "elsewhere.gguf"
    shutil.copy(tiny_path("llama", seed=6), frozen)
    frozen.chmod(0o444)
    monkeypatch.setattr(os, "link", cross_device)
    with caplog.at_level(logging.INFO, logger="pebbling"):
        copy(env, "elsewhere", "crossed")
    assert not os.path.samefile(blob_of("crossed"), frozen)
    assert "not linked, the store is on another file system" in said(caplog)
    assert not [p for p in (blob_of("crossed").parent).iterdir() if p.name.startswith(".new-")]  # nothing left

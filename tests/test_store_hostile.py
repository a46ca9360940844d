"""Model management against a hostile registry and a store with links in it: two pulls of one blob at once
download it once and store its digest's bytes; a body longer, shorter or endless is a failed attempt that
writes nothing past the blob's size; a manifest's size that is no size is refused; a pull whose client
leaves, or whose deadline passes, stops and lets go of its blob, even while the registry stalls it; pulls
hanging on a slow registry never keep listing, showing or generating from answering; no write or delete
goes through a link out of the store, nor through a partial download that is a link; a file removed by a
concurrent delete is absent, not a 500; a full disk is a 507 that leaves nothing partial; and an error
never closes the kept-alive connection under the client."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests

from helpers import tiny_path
from pyplugin.serving import ollama_store, pull as pull_module
from registry import serving_registry
from server_patch import create_app
from server_patch.local import serving

RETRIES = pull_module.RETRIES


def gguf(seed: int) -> bytes:
    return tiny_path("llama", seed=seed).read_bytes()


@pytest.fixture(scope="module")
def registry():
    with serving_registry() as registry:
        registry.add("library", "tiny", "latest", {"model": gguf(30)})
        yield registry


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("ollama")


@pytest.fixture(scope="module")
def server(registry, store, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(store))
    patch.setenv("PEBBLING_REGISTRY", registry.url)
    models = tmp_path_factory.mktemp("models")
    (models / "local.gguf").write_bytes(gguf(29))  # a file of the models directory, which copy imports
    app = create_app(models_dir=models)
    with serving(app) as url:
        yield url, app
    patch.undo()


@pytest.fixture
def url(server):
    return server[0]


def pull(url, name: str, stream: bool = False, timeout: float = 60) -> requests.Response:
    return requests.post(f"{url}/api/pull", json={"model": name, "stream": stream}, timeout=timeout)


def blob(store: Path, digest: str) -> Path:
    return store / "blobs" / digest.replace(":", "-")


def partial(store: Path, digest: str) -> Path:
    return store / "blobs" / f"{digest.replace(':', '-')}.pebbling-partial"


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def listed(url) -> set[str]:
    r = requests.get(f"{url}/api/tags", timeout=30)
    assert r.status_code == 200, r.text
    return {m["name"] for m in r.json()["models"]}


# ---------------------------------------------------------------------------------------------------
# the registry


def test_two_pulls_of_one_blob_at_once_download_it_once_and_store_its_bytes(url, registry, store):
    data = gguf(31)
    digest = registry.add("library", "concur", "latest", {"model": data})["model"]
    registry.pieces[digest] = (20, 0.03)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: pull(url, "concur"), range(2)))
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert [r.json() for r in answers] == [{"status": "success"}] * 2
    assert sha256(blob(store, digest)) == digest
    assert registry.blob_gets(digest) == 1  # the second pull waited for the first, then found the blob
    assert not partial(store, digest).exists()


def test_a_manifest_naming_one_blob_twice_downloads_it_once(url, registry, store):
    data = gguf(32)
    digest = registry.add("library", "twice", "latest", {"model": data})["model"]
    manifest = json.loads(registry.manifests[("library", "twice", "latest")])
    manifest["layers"].append(dict(manifest["layers"][0]))
    registry.add_manifest("library", "twice", "latest", manifest)
    lines = [json.loads(line) for line in pull(url, "twice", stream=True).text.splitlines()]
    assert lines[-1] == {"status": "success"}, lines[-1]
    assert registry.blob_gets(digest) == 1 and sha256(blob(store, digest)) == digest


@pytest.mark.parametrize("misbehaviour,says", [
    ("extra", "more than the"),
    ("endless", "more than the"),
    ("short", "broke off at"),  # the body is shorter than its Content-Length
])
def test_a_body_longer_or_shorter_than_the_blob_is_a_failed_attempt_and_nothing_is_written_past_it(
        url, registry, store, misbehaviour, says):
    data = gguf({"extra": 33, "endless": 34, "short": 35}[misbehaviour])
    digest = registry.add("library", f"body-{misbehaviour}", "latest", {"model": data})["model"]
    if misbehaviour == "extra":
        registry.extra[digest] = b"!"
    elif misbehaviour == "endless":
        registry.endless.add(digest)
    else:
        registry.short[digest] = len(data) // 3
    started = time.monotonic()
    r = pull(url, f"body-{misbehaviour}")
    assert r.status_code == 502 and says in r.json()["error"] and f"{RETRIES} retries" in r.json()["error"], r.text
    assert time.monotonic() - started < 30
    assert registry.blob_gets(digest) <= RETRIES + 1
    assert not blob(store, digest).exists()
    kept = partial(store, digest)
    assert not kept.exists() or kept.stat().st_size <= len(data)
    assert f"body-{misbehaviour}:latest" not in listed(url)


@pytest.mark.parametrize("size,says", [(True, "no size"), ("12", "no size"), (-1, "no size")])
def test_a_manifest_whose_size_is_no_size_is_refused(url, registry, size, says):
    digest = registry.add("library", "sizes", "latest", {"model": gguf(40)})["model"]
    manifest = json.loads(registry.manifests[("library", "sizes", "latest")])
    manifest["layers"][0]["size"] = size
    registry.add_manifest("library", "sizes", "latest", manifest)
    r = pull(url, "sizes")
    assert r.status_code == 502 and says in r.json()["error"], r.text
    assert registry.blob_gets(digest) == 0


def test_a_manifest_size_of_zero_for_a_blob_with_bytes_ends_after_its_retries(url, registry, store):
    digest = registry.add("library", "zero", "latest", {"model": gguf(41)})["model"]
    manifest = json.loads(registry.manifests[("library", "zero", "latest")])
    manifest["layers"][0]["size"] = 0
    registry.add_manifest("library", "zero", "latest", manifest)
    r = pull(url, "zero", timeout=30)
    assert r.status_code == 502, r.text
    assert registry.blob_gets(digest) <= RETRIES + 1
    assert not blob(store, digest).exists()
    assert not partial(store, digest).exists() or partial(store, digest).stat().st_size == 0


def test_a_redirect_to_another_host_is_followed_and_logged(url, registry, store, caplog):
    data = gguf(42)
    digest = registry.add("library", "moved", "latest", {"model": data})["model"]
    registry.redirect.add(digest)
    with caplog.at_level(logging.INFO, logger="pebbling.server"):
        r = pull(url, "moved")
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    assert sha256(blob(store, digest)) == digest
    assert any("redirected to another host" in rec.getMessage() and "localhost" in rec.getMessage()
               for rec in caplog.records)


def test_a_pull_stops_at_its_deadline_and_keeps_what_it_fetched(url, registry, store, monkeypatch):
    data = gguf(43)
    digest = registry.add("library", "late", "latest", {"model": data})["model"]
    registry.drip[digest] = 0.2
    monkeypatch.setenv("PEBBLING_PULL_DEADLINE", "1")
    r = pull(url, "late")
    assert r.status_code == 504 and "deadline" in r.json()["error"], r.text
    registry.drip.pop(digest)
    monkeypatch.delenv("PEBBLING_PULL_DEADLINE")
    kept = partial(store, digest).stat().st_size
    assert 0 < kept < len(data)
    assert pull(url, "late").json() == {"status": "success"}
    assert registry.ranges(digest)[-1] == f"bytes={kept}-" and sha256(blob(store, digest)) == digest


def test_a_pull_the_registry_stalls_stops_at_its_deadline_not_at_the_registrys_timeout(url, registry, store,
                                                                                       monkeypatch):
    data = gguf(46)
    digest = registry.add("library", "stalled", "latest", {"model": data})["model"]
    registry.pieces[digest] = (2, 3600.0)  # half of it, then nothing (until the registry stops)
    monkeypatch.setenv("PEBBLING_PULL_DEADLINE", "1")
    started = time.monotonic()
    r = pull(url, "stalled")
    assert r.status_code == 504 and "deadline" in r.json()["error"], r.text
    assert time.monotonic() - started < 5  # the read was cut at the deadline; the timeout is 30 s
    registry.pieces.pop(digest)
    monkeypatch.delenv("PEBBLING_PULL_DEADLINE")
    assert pull(url, "stalled").json() == {"status": "success"} and sha256(blob(store, digest)) == digest


def test_a_pull_the_registry_stalls_lets_go_of_its_blob_once_its_client_leaves(url, registry, store):
    data = gguf(47)
    digest = registry.add("library", "stalled-left", "latest", {"model": data})["model"]
    registry.pieces[digest] = (2, 3600.0)
    with pytest.raises(requests.Timeout):
        pull(url, "stalled-left", timeout=1)
    registry.pieces.pop(digest)
    started = time.monotonic()
    r = pull(url, "stalled-left", timeout=30)  # waits for the left pull's download, which it then takes over
    assert r.json() == {"status": "success"} and sha256(blob(store, digest)) == digest
    assert time.monotonic() - started < 5


def test_abandoned_pulls_are_stopped_and_never_keep_the_server_from_answering(url, registry, store):
    data = gguf(44)
    digest = registry.add("library", "drip", "latest", {"model": data})["model"]
    registry.drip[digest] = 0.5

    def abandoned(stream: bool) -> None:
        """Gone after 2 s (a streamed pull sends progress all the while, so the client closes it)."""
        try:
            with requests.post(f"{url}/api/pull", json={"model": "drip", "stream": stream}, timeout=2,
                               stream=stream) as r:
                given_up = time.monotonic() + 2
                for _ in r.iter_lines():
                    if time.monotonic() > given_up:
                        break
        except requests.RequestException:
            pass  # gone: that is the point

    with ThreadPoolExecutor(48) as pool:
        list(pool.map(abandoned, [i % 6 == 0 for i in range(48)]))
    for ask in (lambda: requests.get(f"{url}/api/tags", timeout=5),
                lambda: requests.post(f"{url}/api/show", json={"model": "tiny"}, timeout=5),
                lambda: requests.delete(f"{url}/api/delete", json={"model": "nothing-here"}, timeout=5)):
        started = time.monotonic()
        r = ask()
        assert time.monotonic() - started < 1.0 and r.status_code < 500, r.text
    # The pulls stop once their clients are gone: the blob's download is let go of, and a pull now has it.
    registry.drip.pop(digest)
    r = pull(url, "drip", timeout=30)
    assert r.json() == {"status": "success"} and sha256(blob(store, digest)) == digest


def test_a_blob_a_concurrent_delete_removed_before_the_manifest_is_written_is_fetched_again(
        url, registry, store, monkeypatch):
    data = gguf(49)
    digest = registry.add("library", "shared", "latest", {"model": data})["model"]
    write = pull_module.write_manifest_bytes
    calls = []

    def deleted_first(name, raw, root=None):
        if name.model == "shared":  # (pulls an earlier test abandoned may still be ending in this server)
            calls.append(name)
            if len(calls) == 1:
                blob(store, digest).unlink()  # as a delete of another model naming the blob would
        return write(name, raw, root)

    monkeypatch.setattr(pull_module, "write_manifest_bytes", deleted_first)
    assert pull(url, "shared").json() == {"status": "success"}
    assert len(calls) == 2 and registry.blob_gets(digest) == 2 and sha256(blob(store, digest)) == digest
    assert "shared:latest" in listed(url)


# ---------------------------------------------------------------------------------------------------
# the store


@pytest.fixture
def outside(tmp_path) -> Path:
    place = tmp_path / "elsewhere"
    place.mkdir()
    (place / "m").write_text(json.dumps({"layers": []}))
    return place


def test_no_copy_or_delete_goes_through_a_link_out_of_the_store(url, registry, store, outside):
    assert pull(url, "tiny").json() == {"status": "success"}
    link = store / "manifests" / "registry.ollama.ai" / "evil"
    link.symlink_to(outside, target_is_directory=True)
    try:
        r = requests.post(f"{url}/api/copy", json={"source": "tiny", "destination": "evil/n"}, timeout=30)
        assert r.status_code == 400 and "link" in r.json()["error"], r.text
        assert sorted(p.name for p in outside.iterdir()) == ["m"]
        r = requests.delete(f"{url}/api/delete", json={"model": "evil/m"}, timeout=30)
        assert r.status_code == 400 and "link" in r.json()["error"], r.text
        assert (outside / "m").exists()
        assert "tiny:latest" in listed(url)
    finally:
        link.unlink()


def test_a_partial_download_that_is_a_link_out_is_replaced_never_written_through(url, registry, store, outside):
    data = gguf(48)
    digest = registry.add("library", "partial-link", "latest", {"model": data})["model"]
    before = (outside / "m").read_bytes()
    partial(store, digest).symlink_to(outside / "m")
    r = pull(url, "partial-link")
    assert r.json() == {"status": "success"}, r.text
    assert sha256(blob(store, digest)) == digest and not partial(store, digest).exists()
    assert (outside / "m").read_bytes() == before and sorted(p.name for p in outside.iterdir()) == ["m"]


def test_no_blob_is_written_through_a_blobs_directory_that_links_out(tmp_path, outside, monkeypatch):
    from pyplugin.serving.store_write import StoreError, write_blob

    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "blobs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreError, match="link"):
        write_blob(b"bytes", tmp_path / "store")
    assert sorted(p.name for p in outside.iterdir()) == ["m"]


def test_a_manifest_deleted_between_its_lookup_and_its_read_is_absent(tmp_path, monkeypatch):
    (tmp_path / "manifests").mkdir()
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # seen a moment ago; gone when it is read
    assert ollama_store.resolve("gone", tmp_path) is None


def test_concurrent_create_copy_delete_and_listing_never_answer_5xx(url, registry):
    assert pull(url, "tiny").json() == {"status": "success"}
    calls = [
        lambda: requests.post(f"{url}/api/create", json={"model": "race-a", "from": "tiny", "stream": False}),
        lambda: requests.post(f"{url}/api/copy", json={"source": "race-a", "destination": "race-b"}),
        lambda: requests.delete(f"{url}/api/delete", json={"model": "race-a"}),
        lambda: requests.delete(f"{url}/api/delete", json={"model": "race-b"}),
        lambda: requests.get(f"{url}/api/tags"),
        lambda: requests.post(f"{url}/api/show", json={"model": "race-b"}),
        lambda: requests.post(f"{url}/api/generate", json={"model": "race-a", "prompt": "Hi", "stream": False,
                                                           "options": {"num_predict": 1}}),
    ]
    statuses = []
    with ThreadPoolExecutor(14) as pool:
        for _ in range(8):
            statuses += [r.status_code for r in pool.map(lambda call: call(), calls * 2)]
    assert all(s < 500 for s in statuses), sorted(set(statuses))
    assert "tiny:latest" in listed(url)


@pytest.fixture
def full_disk(tmp_path):
    """A store on a file system of 256 KiB (a tmpfs: mounting one needs root, as CI has)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"a small file system cannot be mounted here ({done.stderr.decode().strip()}): needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)  # lazily: the server may still hold a file there


def test_a_full_disk_is_a_507_that_names_it_and_leaves_nothing_partial(server, registry, full_disk, monkeypatch):
    url, _ = server
    monkeypatch.setenv("OLLAMA_MODELS", str(full_disk))
    data = gguf(45)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = requests.post(f"{url}/api/blobs/{digest}", data=data, timeout=30)
    assert r.status_code == 507 and "disk is full" in r.json()["error"], r.text
    r = pull(url, "tiny")
    assert r.status_code == 507 and "disk is full" in r.json()["error"], r.text
    r = requests.post(f"{url}/api/copy", json={"source": "local", "destination": "copied"}, timeout=30)
    assert r.status_code == 507 and "disk is full" in r.json()["error"], r.text  # the file imported as a blob
    left = [p.name for p in (full_disk / "blobs").iterdir()]
    assert left == [], left
    r = requests.get(f"{url}/api/tags", timeout=10)
    assert r.status_code == 200


def test_an_error_answer_keeps_the_kept_alive_connection_usable(server, monkeypatch):
    url, app = server
    engine = app.state.engine

    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "list_models", broken)
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    try:
        for _ in range(3):
            conn.request("GET", "/api/tags")
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == 500 and "internal error" in body["error"]
            assert (r.getheader("connection") or "").lower() != "close"
            conn.request("GET", "/api/version")  # on the same connection
            r = conn.getresponse()
            assert r.status == 200 and "version" in json.loads(r.read())
    finally:
        conn.close()

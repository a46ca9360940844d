"""`ollama pull` over Ollama's registry protocol (the OCI distribution API), into Ollama's store.

    GET {base}/v2/{namespace}/{model}/manifests/{tag}     the manifest: a config and layers, by digest
    GET {base}/v2/{namespace}/{model}/blobs/{digest}      each blob (a redirect to a CDN is followed)

{base} is $PEBBLING_REGISTRY for names of Ollama's registry (default https://registry.ollama.ai), and
https://HOST (http:// with insecure) for a name that carries its own host. Each blob is downloaded to
blobs/sha256-<hex>.pebbling-partial; a download that breaks off is retried from where it stopped (an
HTTP Range request) and, failing that, resumed by the next pull. Every blob is verified against its digest before
it is named: a blob whose bytes do not match is removed and the pull refused, saying so. The manifest is
written last, so a model is listed only once all of it is there. Progress comes as Ollama's objects:
"pulling manifest", "pulling <digest>" with total and completed, "verifying sha256 digest", "writing
manifest", "success".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from .ollama_store import DEFAULT_HOST, MODEL_MEDIA_TYPE, OllamaName, parse_name
from .store_write import (BlobWriter, DigestMismatch, RegistryError, RegistryNotFound, StoreError, blob_path,
                          digest_hex, write_manifest_bytes)

REGISTRY_ENV = "PEBBLING_REGISTRY"
DEFAULT_REGISTRY = "https://registry.ollama.ai"
MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
MAX_MANIFEST_BYTES = 1 << 20
RETRIES = 3              # a broken-off download is resumed this many times within one pull
PROGRESS_EVERY_S = 0.1   # at most this often a progress object per blob (and at its end)


def registry_base(name: OllamaName, insecure: bool = False) -> str:
    if name.host == DEFAULT_HOST:
        return (os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).rstrip("/")
    return f"{'http' if insecure else 'https'}://{name.host}"


def pull_model(name: str, root: Path | None = None, *, insecure: bool = False,
               timeout: float = 60.0) -> Iterator[dict[str, Any]]:
    """Checks the name (InvalidModelName) and returns the pull's progress; RegistryError (RegistryNotFound
    for a name the registry does not have) or StoreError while it runs."""
    parsed = parse_name(name)
    return _pull(parsed, root, registry_base(parsed, insecure), timeout)


def _pull(name: OllamaName, root: Path | None, base: str, timeout: float) -> Iterator[dict[str, Any]]:
    yield {"status": "pulling manifest"}
    writers: list[tuple[BlobWriter, dict[str, Any]]] = []
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 15.0)), follow_redirects=True) as client:
            raw, layers = _manifest(client, base, name)
            for layer in layers:
                writer = yield from _download(client, base, name, layer, root)
                if writer is not None:
                    writers.append((writer, layer))
        yield {"status": "verifying sha256 digest"}
        while writers:
            writer, layer = writers.pop(0)
            try:
                writer.commit()
            except DigestMismatch as exc:
                raise RegistryError(f"pulling '{name.display}': blob {layer['digest']} is corrupt: {exc}; "
                                    "pull again (a registry or proxy that keeps sending other bytes is at "
                                    "fault)") from None
        yield {"status": "writing manifest"}
        write_manifest_bytes(name, raw, root)
        yield {"status": "success"}
    finally:
        for writer, _ in writers:  # stopped early: what was fetched stays for the next pull to resume
            writer.abort(keep=True)


def _manifest(client: httpx.Client, base: str, name: OllamaName) -> tuple[bytes, list[dict[str, Any]]]:
    url = f"{base}/v2/{name.namespace}/{name.model}/manifests/{name.tag}"
    try:
        r = client.get(url, headers={"Accept": MANIFEST_ACCEPT})
    except httpx.HTTPError as exc:
        raise RegistryError(f"pulling '{name.display}': cannot reach the registry at {base} ({exc}); set "
                            f"${REGISTRY_ENV} to use another") from None
    if r.status_code == 404:
        raise RegistryNotFound(f"pulling '{name.display}': the registry at {base} has no such model or tag "
                               f"(manifest {name.namespace}/{name.model}:{name.tag} not found)")
    if r.status_code != 200:
        raise RegistryError(f"pulling '{name.display}': the registry at {base} answered the manifest request "
                            f"with HTTP {r.status_code}: {r.text[:200]}")
    raw = r.content
    try:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"it is over {MAX_MANIFEST_BYTES} bytes")
        data = json.loads(raw)
        layers = [*data["layers"], data["config"]] if data.get("config") else list(data["layers"])
        for layer in layers:
            digest_hex(layer["digest"])
            if not isinstance(layer.get("size"), int) or layer["size"] < 0:
                raise ValueError(f"layer {layer['digest']} has no size")
    except (ValueError, KeyError, TypeError, AttributeError, StoreError) as exc:
        raise RegistryError(f"pulling '{name.display}': the registry's manifest is not one pebbling can read "
                            f"({exc})") from None
    if not any(layer.get("mediaType") == MODEL_MEDIA_TYPE for layer in layers):
        raise RegistryError(f"pulling '{name.display}': its manifest has no GGUF model layer ({MODEL_MEDIA_TYPE}); "
                            "pebbling serves GGUF models")
    return raw, layers


def _download(client: httpx.Client, base: str, name: OllamaName, layer: dict[str, Any],
              root: Path | None) -> Iterator[dict[str, Any]]:
    """Yields progress; returns the writer holding the whole blob (None: the store has it already)."""
    digest, total = layer["digest"], layer["size"]
    status = {"status": f"pulling {digest_hex(digest)[:12]}", "digest": digest, "total": total}
    if blob_path(digest, root).is_file():
        yield {**status, "completed": total}
        return None
    writer = BlobWriter(digest, root, resume=True)
    url = f"{base}/v2/{name.namespace}/{name.model}/blobs/{digest}"
    failures, last, fetched = 0, 0.0, False
    try:
        while True:
            if writer.size > total:  # not the blob's start after all: begin again
                writer.restart()
            yield {**status, "completed": writer.size}
            if writer.size == total and (total or fetched):
                return writer
            fetched = True
            try:
                headers = {"Range": f"bytes={writer.size}-"} if writer.size else {}
                with client.stream("GET", url, headers=headers) as r:
                    if r.status_code == 200 and writer.size:
                        writer.restart()  # the server sends the whole blob, not the rest
                    elif r.status_code == 416:
                        writer.restart()
                        continue
                    elif r.status_code == 404:
                        raise RegistryNotFound(f"pulling '{name.display}': the registry at {base} has no blob "
                                               f"{digest}")
                    elif r.status_code not in (200, 206):
                        raise RegistryError(f"pulling '{name.display}': blob {digest}: the registry answered "
                                            f"HTTP {r.status_code}")
                    for chunk in r.iter_bytes():  # as they come: a buffered chunk would be lost to a cut
                        writer.write(chunk)
                        if time.monotonic() - last >= PROGRESS_EVERY_S:
                            last = time.monotonic()
                            yield {**status, "completed": min(writer.size, total)}
                if writer.size >= total:
                    continue
                raise httpx.RemoteProtocolError(f"the response ended after {writer.size} of {total} bytes")
            except httpx.HTTPError as exc:
                failures += 1
                if failures > RETRIES:
                    raise RegistryError(f"pulling '{name.display}': the download of {digest} broke off at "
                                        f"{writer.size} of {total} bytes ({exc}), {RETRIES} retries too; pull "
                                        "again to resume it") from None
    except BaseException:
        writer.abort(keep=True)
        raise

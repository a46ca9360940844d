"""Writing Ollama's store as Ollama writes it, so that the two share it: blobs by content digest,
manifests by name, copies and deletions.

Writes go to the user's store (ollama_store.models_dir(): $OLLAMA_MODELS, else ~/.ollama/models):
    blobs/sha256-<hex>                                 written under another name, verified, then renamed
    blobs/sha256-<hex>.pebbling-partial                a download in progress (pull.py resumes it; named
                                                       apart from Ollama's own -partial files, which it
                                                       reads as its download's state)
    manifests/<host>/<namespace>/<model>/<tag>         written whole, then renamed
A blob is only ever named by the digest of its bytes: one whose bytes do not hash to its name is removed
and refused. A name is parsed (ollama_store.parse_name) before any path is built from it, so nothing is
written, or deleted, outside the store.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Iterable

from ..errors import ModelError, PebblingError
from . import ollama_store
from .ollama_store import OllamaName, parse_name

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
DIGEST_HELP = "sha256:<64 lowercase hex digits>, the SHA-256 of the blob's bytes"


class StoreError(ModelError):
    """What was asked of the store cannot be done as asked (HTTP 400): the message says why."""


class DigestMismatch(StoreError):
    """Bytes that do not hash to the digest they were sent or fetched as: removed, never stored."""


class RegistryError(PebblingError):
    """The registry could not be reached, or answered what a registry should not (HTTP 502)."""


class RegistryNotFound(RegistryError, LookupError):
    """The registry has no such model or tag (HTTP 404)."""


def store_root(root: str | os.PathLike | None = None) -> Path:
    """The store written to: `root`, else the user's Ollama store."""
    return Path(root) if root is not None else ollama_store.models_dir()


def digest_hex(digest: Any) -> str:
    """The hex of ``sha256:<hex>`` (or Ollama's file form ``sha256-<hex>``); StoreError otherwise."""
    match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if not match:
        shown = repr(digest)[:80]
        raise StoreError(f"invalid digest {shown}: expected {DIGEST_HELP}")
    return match.group(1)


def blob_path(digest: str, root: str | os.PathLike | None = None) -> Path:
    return store_root(root) / "blobs" / f"sha256-{digest_hex(digest)}"


def manifest_path(name: OllamaName, root: str | os.PathLike | None = None) -> Path:
    return store_root(root) / "manifests" / name.host / name.namespace / name.model / name.tag


class BlobWriter:
    """Bytes written towards the blob `digest`, hashed as they come; `commit` verifies and names it.

    ``resume=True``: continue the download's partial file (blobs/sha256-<hex>.pebbling-partial) where it ends;
    otherwise the bytes go to a file of this writer's own, so two uploads of one blob never mix.
    """

    def __init__(self, digest: str, root: str | os.PathLike | None = None, *, resume: bool = False):
        self.hex = digest_hex(digest)
        self.path = blob_path(digest, root)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._hash = hashlib.sha256()
        self.size = 0
        if resume:
            self.partial = self.path.with_name(f"{self.path.name}.pebbling-partial")
            if self.partial.is_file():
                with open(self.partial, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        self._hash.update(chunk)
                        self.size += len(chunk)
            self._file = open(self.partial, "ab")
        else:
            self.partial = self.path.with_name(f"{self.path.name}.pebbling-upload-{secrets.token_hex(4)}")
            self._file = open(self.partial, "wb")

    def restart(self) -> None:
        """Drops what was written (a server that would not resume sends the whole blob again)."""
        self._file.seek(0)
        self._file.truncate()
        self._hash, self.size = hashlib.sha256(), 0

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    def commit(self) -> Path:
        """The blob, verified and in place; DigestMismatch (and the bytes removed) when they are not it."""
        self._file.close()
        actual = self._hash.hexdigest()
        if actual != self.hex:
            self.partial.unlink(missing_ok=True)
            raise DigestMismatch(f"the {self.size} bytes received hash to sha256:{actual}, not to the digest "
                                 f"they were sent as, sha256:{self.hex}: they were refused and removed")
        os.replace(self.partial, self.path)
        return self.path

    def abort(self, keep: bool = False) -> None:
        """Stops; `keep`: leave the partial file for a later resume."""
        self._file.close()
        if not keep:
            self.partial.unlink(missing_ok=True)


def write_blob(data: bytes | Iterable[bytes], root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Stores bytes as a blob (named by their digest); returns its layer fields {digest, size}."""
    chunks = [data] if isinstance(data, bytes) else data
    tmp = store_root(root) / "blobs" / f".new-{secrets.token_hex(6)}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    hasher, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                hasher.update(chunk)
                size += len(chunk)
        digest = f"sha256:{hasher.hexdigest()}"
        os.replace(tmp, blob_path(digest, root))
    finally:
        tmp.unlink(missing_ok=True)
    return {"digest": digest, "size": size}


def import_file(path: Path, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Copies a file into the store as a blob; its layer fields {digest, size}."""
    with open(path, "rb") as f:
        return write_blob(iter(lambda: f.read(1 << 20), b""), root)


def read_manifest(name: OllamaName, root: str | os.PathLike | None = None) -> dict[str, Any] | None:
    path = manifest_path(name, root)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"model '{name.display}': its manifest cannot be read ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise StoreError(f"model '{name.display}': its manifest has no list of layers")
    return data


def write_manifest(name: OllamaName, layers: list[dict[str, Any]], config: dict[str, Any],
                   root: str | os.PathLike | None = None) -> Path:
    """The manifest of `name`, written whole then renamed into place (a reader never sees half of one)."""
    return write_manifest_bytes(name, json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                                                  "config": config, "layers": layers}).encode(), root)


def write_manifest_bytes(name: OllamaName, data: bytes, root: str | os.PathLike | None = None) -> Path:
    path = manifest_path(name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def config_layer(details: dict[str, Any], layers: list[dict[str, Any]],
                 root: str | os.PathLike | None = None) -> dict[str, Any]:
    """A config blob like Ollama's (format, family, the layers' digests), stored; its layer fields."""
    config = {"model_format": details.get("format", "gguf"), "model_family": details.get("family", ""),
              "model_families": details.get("families", []), "model_type": details.get("parameter_size", ""),
              "file_type": details.get("quantization_level", ""),
              "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}}
    return {"mediaType": CONFIG_MEDIA_TYPE, **write_blob(json.dumps(config).encode(), root)}


def copy_manifest(source: OllamaName, destination: OllamaName, root: str | os.PathLike | None = None) -> None:
    data = manifest_path(source, root).read_bytes()
    write_manifest_bytes(destination, data, root)


def delete_model(name: str, root: str | os.PathLike | None = None) -> list[str]:
    """Removes the manifest of `name`, then the blobs it named that no other manifest names; returns the
    digests removed. StoreError (404's LookupError) when the store has no such model."""
    parsed = parse_name(name)
    base = store_root(root)
    path = manifest_path(parsed, base)
    if not path.is_file():
        raise ModelNotInStore(f"model '{name}' not found in Ollama's store")
    try:
        named = _digests(json.loads(path.read_text()))
    except (OSError, ValueError):
        named = set()  # a broken manifest still goes; its blobs, if any, are left
    path.unlink()
    _remove_empty_dirs(path.parent, base / "manifests")
    still_named: set[str] = set()
    for other in (base / "manifests").glob("*/*/*/*"):
        try:
            still_named |= _digests(json.loads(other.read_text()))
        except (OSError, ValueError):
            return []  # a manifest that cannot be read may name any blob: remove none
    removed = []
    for digest in sorted(named - still_named):
        blob = base / "blobs" / f"sha256-{digest}"
        if blob.is_file() and not blob.is_symlink():
            blob.unlink()
            removed.append(f"sha256:{digest}")
    return removed


class ModelNotInStore(StoreError, LookupError):
    """The store has no manifest of that name (HTTP 404)."""


def _digests(manifest: Any) -> set[str]:
    entries = [*manifest.get("layers", []), manifest.get("config")] if isinstance(manifest, dict) else []
    found = set()
    for entry in entries:
        match = _DIGEST.fullmatch(str(entry.get("digest", ""))) if isinstance(entry, dict) else None
        if match:
            found.add(match.group(1))
    return found


def _remove_empty_dirs(directory: Path, stop: Path) -> None:
    while directory != stop and directory.is_relative_to(stop):
        try:
            directory.rmdir()
        except OSError:
            return
        directory = directory.parent

"""Writing Ollama's store as Ollama writes it, so that the two share it: blobs by content digest,
manifests by name, copies and deletions, in the user's store ($OLLAMA_MODELS, else ~/.ollama/models):
    blobs/sha256-<hex>                        written under another name, verified, then renamed
    blobs/sha256-<hex>.pebbling-partial       a download in progress, which pull.py resumes (named apart
                                              from Ollama's -partial files, its own download's state)
    manifests/<host>/<namespace>/<model>/<tag>  written whole, then renamed
A blob is only ever named by the digest of its bytes: one whose bytes do not hash to its name is removed
and refused. One writer at a time holds a download's partial file (an exclusive lock on it, so two pulls
of one blob, in one process or two, never append to it together): the others wait for it, then find the
blob written. A name is parsed (ollama_store.parse_name) before any path is built from it, and every path
written, renamed or deleted is checked to lie inside the store once its links are followed (`inside`), as
reads are, and none is written through a link at its own name (replaced, or made new): nothing is written,
or deleted, outside the store. A write the disk refuses (full, read-only) is a StoreWriteError (HTTP 507)
naming the cause, and leaves no partial file. Manifests are written and deleted under one lock of the
process, so a delete never removes a blob that a manifest written at the same time names.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Any, Iterable

try:
    import fcntl
except ImportError:  # not POSIX: one process's threads still never share a partial file (see _lock)
    fcntl = None  # type: ignore[assignment]

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


class StoreWriteError(PebblingError):
    """The disk refused a write to the store: full, read-only, no permission (HTTP 507). Nothing partial is
    left behind."""


class PastSize(StoreError):
    """Bytes past the size a blob was announced with: refused, never written."""


class BlobsMissing(StoreError):
    """A manifest names a blob the store does not have (a delete removed it): it is not written."""


class BlobBusy(StoreError):
    """Another writer (a pull in this process or another) holds the blob's partial download."""


_STORE_LOCK = threading.RLock()  # manifests written, and models deleted, one at a time in the process
_HELD: set[str] = set()          # partial files this process holds (where flock is not to be had)
_HELD_LOCK = threading.Lock()


def inside(path: Path, root: str | os.PathLike | None = None) -> Path:
    """`path`, when it lies inside the store once every link on the way is followed; StoreError otherwise.
    The last component is not followed: replacing or removing a link replaces or removes the link."""
    base = store_root(root).resolve()
    if not path.parent.resolve().is_relative_to(base):
        raise StoreError(f"the store's entry {path.relative_to(store_root(root)).as_posix()!r} lies under a link "
                         "to a directory outside the store: nothing is written or deleted through it; remove "
                         "the link")
    return path


def _open_unfollowed(path: Path):
    """`path` open to read and append (made when absent), never through a link: a link there is removed and
    the file made anew in its place, as `inside` replaces a link rather than writing through it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.fdopen(os.open(path, flags, 0o666), "a+b")
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
    path.unlink()
    return os.fdopen(os.open(path, flags, 0o666), "a+b")


def write_failed(exc: OSError, what: str) -> StoreWriteError:
    cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
             errno.EROFS: "the file system is read-only"}.get(exc.errno, exc.strerror or str(exc))
    return StoreWriteError(f"cannot write {what} into the model store: {cause}; nothing was kept; free space "
                           "(or fix the store's permissions) and try again")


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
    return inside(store_root(root) / "blobs" / f"sha256-{digest_hex(digest)}", root)


def manifest_path(name: OllamaName, root: str | os.PathLike | None = None) -> Path:
    return inside(store_root(root) / "manifests" / name.host / name.namespace / name.model / name.tag, root)


class BlobWriter:
    """Bytes written towards the blob `digest`, hashed as they come; `commit` verifies and names it.

    ``resume=True``: continue the download's partial file (blobs/sha256-<hex>.pebbling-partial) where it
    ends, holding it alone (BlobBusy while another writer does); otherwise the bytes go to a file of this
    writer's own, so two uploads of one blob never mix. ``size``: the most bytes the blob may have; a
    write past it is refused (ValueError) and nothing of it is written.
    """

    def __init__(self, digest: str, root: str | os.PathLike | None = None, *, resume: bool = False,
                 size: int | None = None):
        self.hex = digest_hex(digest)
        self.path = blob_path(digest, root)
        self.limit = size
        self._hash = hashlib.sha256()
        self.size = 0
        self._held: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume:
                self.partial = self.path.with_name(f"{self.path.name}.pebbling-partial")
                self._file = self._hold(self.partial)
                for chunk in iter(lambda: self._file.read(1 << 20), b""):
                    self._hash.update(chunk)
                    self.size += len(chunk)
            else:
                self.partial = self.path.with_name(f"{self.path.name}.pebbling-upload-{secrets.token_hex(4)}")
                self._file = open(self.partial, "xb")  # a new file: never a link's target
        except OSError as exc:
            raise write_failed(exc, f"blob {digest}") from None

    def _hold(self, path: Path):
        """The partial file, open and locked by this writer alone (the lock held until it is closed)."""
        with _HELD_LOCK:
            if str(path) in _HELD:
                raise BlobBusy(f"blob sha256:{self.hex} is being downloaded by another pull")
            f = _open_unfollowed(path)
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise BlobBusy(f"blob sha256:{self.hex} is being downloaded by another process") from None
                # Locked, but perhaps the file another writer has since renamed or removed: start over then.
                try:
                    same = os.lstat(path).st_ino == os.fstat(f.fileno()).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    raise BlobBusy(f"blob sha256:{self.hex} was just written by another pull")
            except BaseException:
                f.close()
                raise
            _HELD.add(str(path))
            self._held = str(path)
        f.seek(0)
        return f

    def restart(self) -> None:
        """Drops what was written (a server that would not resume sends the whole blob again)."""
        self._file.seek(0)
        self._file.truncate()
        self._hash, self.size = hashlib.sha256(), 0

    def write(self, chunk: bytes) -> None:
        if self.limit is not None and self.size + len(chunk) > self.limit:
            raise PastSize(f"blob sha256:{self.hex}: {self.size + len(chunk)} bytes would be past its size, "
                           f"{self.limit}; nothing past it is written")
        try:
            self._file.write(chunk)
        except OSError as exc:
            self.abort()
            raise write_failed(exc, f"blob sha256:{self.hex}") from None
        self._hash.update(chunk)
        self.size += len(chunk)

    def matches(self) -> bool:
        """Whether the bytes written so far are the blob's."""
        return self._hash.hexdigest() == self.hex

    def commit(self) -> Path:
        """The blob, verified and in place; DigestMismatch (and the bytes removed) when they are not it."""
        try:
            self._file.flush()
            on_disk = os.fstat(self._file.fileno()).st_size
        except OSError as exc:
            self.abort()
            raise write_failed(exc, f"blob sha256:{self.hex}") from None
        if not self.matches() or on_disk != self.size:
            actual = self._hash.hexdigest()
            self.abort()
            raise DigestMismatch(f"the {self.size} bytes received hash to sha256:{actual} ({on_disk} on disk), not "
                                 f"to the digest they were sent as, sha256:{self.hex}: they were refused and removed")
        try:
            os.replace(self.partial, self.path)  # while the lock is held: no other writer has the file
        except OSError as exc:
            self.abort()
            raise write_failed(exc, f"blob sha256:{self.hex}") from None
        self._close()
        return self.path

    def abort(self, keep: bool = False) -> None:
        """Stops; `keep`: leave the partial file for a later resume."""
        if not keep:
            self.partial.unlink(missing_ok=True)  # before the lock goes: a waiter never takes a removed file
        self._close()

    def _close(self) -> None:
        self._file.close()
        with _HELD_LOCK:
            if self._held is not None:
                _HELD.discard(self._held)
                self._held = None


def write_blob(data: bytes | Iterable[bytes], root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Stores bytes as a blob (named by their digest); returns its layer fields {digest, size}."""
    chunks = [data] if isinstance(data, bytes) else data
    tmp = inside(store_root(root) / "blobs" / f".new-{secrets.token_hex(6)}", root)
    hasher, size = hashlib.sha256(), 0
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            for chunk in chunks:
                f.write(chunk)
                hasher.update(chunk)
                size += len(chunk)
        digest = f"sha256:{hasher.hexdigest()}"
        os.replace(tmp, blob_path(digest, root))
    except OSError as exc:
        raise write_failed(exc, f"a blob of {size} bytes or more") from None
    finally:
        tmp.unlink(missing_ok=True)
    return {"digest": digest, "size": size}


def read_manifest(name: OllamaName, root: str | os.PathLike | None = None) -> dict[str, Any] | None:
    path = manifest_path(name, root)
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None  # none, or deleted a moment ago
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
    """Writes a manifest whole, then renames it into place. Under the store's lock, and only while every
    blob it names is in the store: a delete running at the same time may have removed one it shares."""
    path = manifest_path(name, root)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with _STORE_LOCK:
        missing = [d for d in sorted(_named(data)) if not blob_path(f"sha256:{d}", root).is_file()]
        if missing:
            raise BlobsMissing(f"model '{name.display}': blob sha256:{missing[0]} it names is not in the store "
                               "(a delete removed it meanwhile?); nothing was written; try again")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            raise write_failed(exc, f"the manifest of '{name.display}'") from None
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
    try:
        data = manifest_path(source, root).read_bytes()
    except FileNotFoundError:
        raise ModelNotInStore(f"model '{source.display}' not found in Ollama's store") from None
    except OSError as exc:
        raise StoreError(f"model '{source.display}': its manifest cannot be read ({exc.strerror})") from None
    write_manifest_bytes(destination, data, root)


def delete_model(name: str, root: str | os.PathLike | None = None) -> list[str]:
    """Removes the manifest of `name`, then the blobs it named that no other manifest names; returns the
    digests removed. StoreError (404's LookupError) when the store has no such model."""
    parsed = parse_name(name)
    base = store_root(root)
    path = manifest_path(parsed, base)
    inside(base / "blobs" / "sha256-", base)  # its blobs are removed below: never through a link out
    with _STORE_LOCK:
        try:
            raw = path.read_bytes()
            path.unlink()
        except (FileNotFoundError, IsADirectoryError):
            raise ModelNotInStore(f"model '{name}' not found in Ollama's store") from None
        named = _named(raw)  # a broken manifest still goes; its blobs, if any, are left
        _remove_empty_dirs(path.parent, base / "manifests")
        still_named: set[str] = set()
        for other in ollama_store.manifest_files(base):
            try:
                still_named |= _digests(json.loads(other.read_bytes()))
            except FileNotFoundError:
                continue  # deleted meanwhile by Ollama itself: names nothing
            except (OSError, ValueError):
                return []  # a manifest that cannot be read may name any blob: remove none
        removed = []
        for digest in sorted(named - still_named):
            blob = blob_path(f"sha256:{digest}", base)
            if blob.is_file() and not blob.is_symlink():
                blob.unlink(missing_ok=True)
                removed.append(f"sha256:{digest}")
    return removed


class ModelNotInStore(StoreError, LookupError):
    """The store has no manifest of that name (HTTP 404)."""


def _named(raw: bytes) -> set[str]:
    """The blobs a manifest's bytes name (none when they are not JSON)."""
    try:
        return _digests(json.loads(raw))
    except ValueError:
        return set()


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

"""The model catalogue: every model that can be served and what is known of it before loading.

Names resolve through one lookup, registry.locate: the demo, the models directory, then Ollama's local
store (ollama_store.py) with the Modelfile layers of the name found there; listings and /api/show details
are read from the file's header and cached while the file is unchanged, within a bound: /api/show holds
every scalar of a file's metadata, which a crafted file makes tens of MB.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import ModelError, PebblingError
from ..ggml_types import SUPPORTED_NAMES, SUPPORTED_TYPES
from ..model import GGUFFile
from ..model.load import SUPPORTED_ARCHS
from ..model.vocabulary import fim_token_ids
from . import ollama_store, registry


def with_tag(name: str) -> str:
    """A model's name as Ollama shows it: with its tag, `:latest` where none was given."""
    return name if ":" in name.rpartition("/")[2] else f"{name}:latest"


class ModelNotFoundError(ModelError, LookupError):
    """No model has that name (HTTP 404)."""


class ModelLoadError(ModelError):
    """A model's file cannot be served (HTTP 400); the message names the model, not its path."""


class ServerBusyError(PebblingError):
    """Too many requests are queued or running (HTTP 503)."""


@contextmanager
def model_errors(name: str, path: Path) -> Iterator[None]:
    """ModelErrors raised for `path` become ModelLoadErrors that name the model instead: where the
    server keeps its files is nobody's business but its own."""
    try:
        yield
    except ModelLoadError:
        raise
    except ModelError as exc:
        # The file's directory is hidden before the name goes in: a name that is itself a path (run's
        # files) keeps its directory.
        message = str(exc).replace(str(path), "\0").replace(str(path.parent), "the models directory")
        message = message.replace("\0", f"model '{name}'")
        raise ModelLoadError(f"model '{name}' cannot be served: {message}") from None


@dataclass(frozen=True)
class ModelListing:
    """A model that can be served, for /api/tags and /api/show."""

    name: str
    path: Path
    size: int
    modified: float                   # seconds since the epoch
    digest: str                       # hex
    details: dict[str, Any]


@dataclass(frozen=True)
class RunningModel:
    """A loaded model, for /api/ps."""

    name: str
    path: Path
    size: int                         # bytes it holds (host weights)
    size_vram: int                    # bytes it holds in device memory, as last measured
    expires_at: float                 # seconds since the epoch; inf = never
    details: dict[str, Any]
    digest: str
    active: int                       # requests queued or running on it
    context_length: int = 0           # the num_ctx its KV cache is sized for (Ollama's context_length)
    placement: dict[str, Any] | None = None  # where its weights are: /api/ps's "pebbling" (Engine.running)


# What the catalogue keeps of files' headers, the least recently used going first past either bound; a
# file's details alone past the bytes are read again each time rather than kept.
INFO_CACHE_ENTRIES = 64
INFO_CACHE_BYTES = 16 << 20
_ITEM_BYTES = 128  # a metadata item in memory beside its text: its key and value objects and its dict slot


class Catalogue:
    """The models of one models directory, the demo and Ollama's store; thread-safe."""

    def __init__(self, models_dir: str | Path | None = None, *, cache_entries: int = INFO_CACHE_ENTRIES,
                 cache_bytes: int = INFO_CACHE_BYTES):
        """`cache_entries`, `cache_bytes`: the most files' details kept, and the most bytes they hold."""
        self.models_dir = Path(models_dir) if models_dir is not None else registry.default_models_dir()
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        # By resolved path: (size, mtime_ns) of the version read, its details, about the bytes they hold
        self._info_cache: OrderedDict[str, tuple[tuple[int, int], dict[str, Any], int]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def resolve(self, name: str) -> Path:
        """The GGUF file for a model name. InvalidModelName before any file access for a name that
        could be a path; ModelNotFoundError when nothing has that name."""
        return self.find(name)[0]

    def find(self, name: str) -> tuple[Path, ollama_store.ModelLayers]:
        """The GGUF file for a model name and its Modelfile layers (none outside Ollama's store)."""
        ollama_store.parse_name(name)
        self.drop_stale()
        try:
            return registry.locate(name, self.models_dir, allow_paths=False)
        except registry.NotFoundError as exc:
            raise ModelNotFoundError(f"model '{name}' not found") from exc
        except ModelError as exc:  # found, and cannot be read: a broken manifest, a link out, an unwritable demo
            message = str(exc).replace(str(self.models_dir), "the models directory")
            raise ModelLoadError(f"model '{name}' cannot be served: {message}") from None

    def list_models(self) -> list[ModelListing]:
        """Every model that can be served: the demo, the models directory, Ollama's store."""
        self.drop_stale()
        found: dict[str, Path] = {}
        for name in registry.available(self.models_dir):
            try:
                found[name] = registry.resolve(name, self.models_dir, allow_paths=False)
            except ModelError:
                continue  # e.g. the demo cannot be written here; /api/tags still answers
        in_store: dict[str, ollama_store.OllamaModel] = {}
        for m in ollama_store.list_models():
            if found.setdefault(m.name, m.path) == m.path:
                in_store[m.name] = m
        listings = []
        for name, path in sorted(found.items()):
            try:
                listings.append(self.listing(with_tag(name), path, in_store.get(name)))
            except (ModelError, OSError):
                continue  # an unreadable file is not offered; asking for it by name says why
        return listings

    def listing(self, name: str, path: Path, in_store: ollama_store.OllamaModel | None = None) -> ModelListing:
        info = self.info(path)
        return ModelListing(name, path, info["size"], info["modified"], self.model_id(name, path, in_store),
                            info["details"])

    def model_id(self, name: str, path: Path, in_store: ollama_store.OllamaModel | None = None) -> str:
        """The digest (hex) a model is listed by wherever it is listed: /api/tags, /api/ps and /api/show
        give it whole, `pebbling list` and `ps` its first 12 digits, as `ollama list` and `ps` show IDs.
        For a model of Ollama's store it is Ollama's own, the SHA-256 of its manifest's bytes (`in_store`,
        else looked up by `name`), so that `ollama list` and `pebbling list` show the same ID for it; for
        any other file, the file's (see _read_info). The one place an ID is computed."""
        if in_store is None and path.name.startswith("sha256-"):
            try:
                in_store = ollama_store.resolve(name)
            except (ModelError, OSError):
                in_store = None  # deleted meanwhile, or not a store name: the file's own ID
        if in_store is not None and in_store.manifest_digest and in_store.path.resolve() == path.resolve():
            return in_store.manifest_digest
        return self.info(path)["digest"]

    def info(self, path: Path) -> dict[str, Any]:
        """Details read from the file's header (size, modified, digest, details, show), cached while
        the file is unchanged (a file changed replaces its entry)."""
        st = path.stat()
        key, stamp = str(path.resolve()), (st.st_size, st.st_mtime_ns)
        with self._lock:
            held = self._info_cache.get(key)
            if held is not None and held[0] == stamp:
                self._info_cache.move_to_end(key)
                return held[1]
        info = _read_info(path, st)
        self.drop_stale()
        with self._lock:
            self._forget(key)
            size = _held_bytes(info)
            if size <= self.cache_bytes:
                self._info_cache[key] = (stamp, info, size)
                self._cached_bytes += size
            while len(self._info_cache) > self.cache_entries or self._cached_bytes > self.cache_bytes:
                self._forget(next(iter(self._info_cache)))
        return info

    def drop_stale(self) -> None:
        """Forgets the details of files deleted or changed since they were read (a model deleted, a blob
        replaced): nothing is kept of a file that is gone."""
        with self._lock:
            held = [(key, stamp) for key, (stamp, _, _) in self._info_cache.items()]
        stale = [key for key, stamp in held if _stamp(key) != stamp]
        with self._lock:
            for key in stale:
                self._forget(key)

    def cached(self) -> tuple[int, int]:
        """(files whose details are kept, about the bytes they hold)."""
        with self._lock:
            return len(self._info_cache), self._cached_bytes

    def _forget(self, key: str) -> None:
        held = self._info_cache.pop(key, None)
        if held is not None:
            self._cached_bytes -= held[2]


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _held_bytes(info: dict[str, Any]) -> int:
    """About the memory a file's details hold: its metadata's scalars, each a key and a value."""
    show = info["show"]
    items = sum(_ITEM_BYTES + len(k) + (len(v) if isinstance(v, str) else 0) for k, v in show["model_info"].items())
    return 4096 + items + len(show["template"]) + len(show["license"])


def _read_info(path: Path, st) -> dict[str, Any]:
    with GGUFFile(path) as f:
        md = f.metadata
        arch = str(md.get("general.architecture", "unknown"))
        n_params = sum(math.prod(t.shape) for t in f.tensors.values())
        by_type = Counter()
        without_kernels = {}  # the first tensor of each type pebbling does not compute, said before a load
        for t in f.tensors.values():
            if len(t.shape) >= 2:
                by_type[t.qtype.name] += t.nbytes
            if int(t.qtype) not in SUPPORTED_TYPES:
                without_kernels.setdefault(t.qtype.name, t.name)
        scalars = {k: v for k, v in md.items()
                   if not isinstance(v, (list, bytes)) and k != "tokenizer.chat_template"}
    most_bytes = by_type.most_common(1)[0][0] if by_type else "unknown"
    quant = _file_type(md.get("general.file_type")) or most_bytes
    details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
               "parameter_size": format_parameters(n_params), "quantization_level": quant}
    # The file's own ID, for model_id. A content digest of a multi-GB file is too slow for a listing (a
    # 98 MB file takes a tenth of a second, a 40 GB one most of a minute): a blob of Ollama's store is
    # named by its content digest already, and elsewhere the resolved path, size and mtime identify this
    # version of the file (it changes when the file does; it is not the SHA-256 of its bytes).
    digest = path.name[len("sha256-"):] if path.name.startswith("sha256-") else hashlib.sha256(
        f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    scalars["general.parameter_count"] = n_params
    show = {"model_info": scalars, "template": md.get("tokenizer.chat_template", ""),
            "license": str(md.get("general.license", "")), "pools": f"{arch}.pooling_type" in md,
            "fim": fim_token_ids(md.get("tokenizer.ggml.tokens") or [], md) is not None}
    notes = []
    if arch not in SUPPORTED_ARCHS:
        notes.append(f"architecture {arch!r} is not supported by pebbling (supported: "
                     f"{', '.join(SUPPORTED_ARCHS)}): this model cannot be served")
    for name, tensor in without_kernels.items():
        notes.append(f"tensor type {name} (tensor {tensor}) is not computed by pebbling (types: "
                     f"{', '.join(SUPPORTED_NAMES)}): this model cannot be served")
    if notes:
        show["pebbling_notes"] = notes
    return {"size": st.st_size, "modified": st.st_mtime, "digest": digest, "details": details,
            "show": show}


def _file_type(value: Any) -> str | None:
    from gguf import LlamaFileType
    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        return None


def format_parameters(n: int) -> str:
    """Ollama's parameter_size: 8.0B, 494.03M, 12.34K."""
    for unit, size, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 2)):
        if n >= size:
            return f"{n / size:.{digits}f}{unit}"
    return str(n)

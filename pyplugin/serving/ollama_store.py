"""Models pulled with Ollama, found in its local store by name.

Layout ($OLLAMA_MODELS, else ~/.ollama/models and, where Ollama runs as a Linux service,
/usr/share/ollama/.ollama/models):
    manifests/<host>/<namespace>/<model>/<tag>   JSON; its layer with mediaType
                                                 application/vnd.ollama.image.model is the GGUF, and the
                                                 others are what `ollama create` made of a Modelfile:
                                                 .template (a Go template), .system, .params (JSON),
                                                 .messages (JSON), .license, .adapter, .projector
    blobs/sha256-<hex>                           the layer's bytes

A name reads ``[[host/]namespace/]model[:tag]`` as in Ollama (host registry.ollama.ai, namespace
library, tag latest by default). Every part is checked against a strict pattern before any path is
built, so a name such as ``../x`` or ``/etc/passwd`` is refused without touching the file system.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import ModelError

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
LAYER_PREFIX = "application/vnd.ollama.image."
SERVICE_STORE = Path("/usr/share/ollama/.ollama/models")  # the Linux service's (user ollama) store
MAX_LAYER_BYTES = 1 << 20  # a template, system prompt, params or license: text, never this large
# Layers that change what the model computes, which pebbling does not implement.
UNSUPPORTED_LAYERS = {"adapter": "an adapter (LoRA) layer", "projector": "a projector (vision) layer"}

# Ollama's own name rules: letters, digits, '_', '-', '.', starting with a letter or digit; a host
# may carry a port. A part that starts with '.' is refused, so '.' and '..' can never occur.
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,79}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,252}(:[0-9]{1,5})?")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
NAME_HELP = "a name such as 'llama3.2', 'llama3.2:1b' or 'namespace/model:tag'"


class InvalidModelName(ModelError, ValueError):
    """A model name that could not name a model (and might name a path): refused before any file access."""


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """The short form Ollama shows: defaults left out, except the tag."""
        prefix = ""
        if self.host != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"


@dataclass(frozen=True)
class ModelLayers:
    """What a Modelfile added to the GGUF: Ollama serves the model with these."""

    template: str | None = None                 # TEMPLATE: a Go template, used instead of the GGUF's
    system: str | None = None                   # SYSTEM: the system message when a request sends none
    params: dict[str, Any] = field(default_factory=dict)  # PARAMETER: defaults that request options override
    messages: tuple[dict[str, Any], ...] = ()   # MESSAGE: a conversation every chat starts with
    license: str = ""                           # LICENSE
    unsupported: tuple[str, ...] = ()           # ADAPTER, a projector: what keeps it from being served


@dataclass(frozen=True)
class OllamaModel:
    name: str       # display form, e.g. "llama3.2:latest"
    path: Path      # the GGUF blob
    digest: str     # "sha256:<hex>" of the model layer
    size: int       # bytes of the model layer
    modified: float  # the manifest's mtime, seconds since the epoch
    layers: ModelLayers = ModelLayers()
    manifest_digest: str = ""  # hex SHA-256 of the manifest's bytes: the ID `ollama list` shows


def parse_name(name: str) -> OllamaName:
    """Splits and validates a name; raises InvalidModelName naming what was wrong."""
    if not isinstance(name, str) or not name:
        raise InvalidModelName(f"invalid model name {name!r}: expected {NAME_HELP}")
    if "\\" in name or "\x00" in name or ".." in name or name.startswith("/") or "//" in name:
        raise InvalidModelName(f"invalid model name {name!r}: path separators and '..' are not allowed; "
                               f"expected {NAME_HELP}")
    rest, tag = name, DEFAULT_TAG
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = name.rsplit(":", 1)
    parts = rest.split("/")
    if len(parts) > 3:
        raise InvalidModelName(f"invalid model name {name!r}: at most host/namespace/model; "
                               f"expected {NAME_HELP}")
    host = parts[0] if len(parts) == 3 else DEFAULT_HOST
    namespace = parts[-2] if len(parts) >= 2 else DEFAULT_NAMESPACE
    model = parts[-1]
    if not (_HOST.fullmatch(host) and _PART.fullmatch(namespace) and _PART.fullmatch(model)
            and _TAG.fullmatch(tag)):
        raise InvalidModelName(f"invalid model name {name!r}: expected {NAME_HELP} (letters, digits, "
                               f"'_', '-', '.')")
    return OllamaName(host, namespace, model, tag)


def models_dir() -> Path:
    """Ollama's store: $OLLAMA_MODELS, else ~/.ollama/models (the directory need not exist)."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def stores() -> list[Path]:
    """Where Ollama keeps models, in the order it would: $OLLAMA_MODELS alone when set, else the user's
    store and then the Linux service's."""
    if os.environ.get("OLLAMA_MODELS"):
        return [models_dir()]
    return [models_dir(), SERVICE_STORE]


def resolve(name: str, root: Path | None = None) -> OllamaModel | None:
    """The model `name` names in the store (the first store that holds it), or None."""
    parsed = parse_name(name)  # before any file-system access
    for base in [Path(root)] if root is not None else stores():
        manifest = base / "manifests" / parsed.host / parsed.namespace / parsed.model / parsed.tag
        if manifest.is_file():
            try:
                return _read_manifest(manifest, base, parsed.display)
            except FileNotFoundError:
                continue  # deleted since it was seen: absent
    return None


def list_models(root: Path | None = None) -> list[OllamaModel]:
    """Every model in the stores whose manifest names a GGUF layer that is present, sorted by name (a
    name in two stores: the first store's)."""
    found: dict[str, OllamaModel] = {}
    for store in [Path(root)] if root is not None else stores():
        base = store / "manifests"
        for manifest in manifest_files(store):
            host, namespace, model, tag = manifest.relative_to(base).parts
            try:
                display = parse_name(f"{host}/{namespace}/{model}:{tag}").display
                entry = _read_manifest(manifest, store, display)
            except (ModelError, OSError):
                continue  # a pull in progress, no model layer, or deleted meanwhile: not a model to list
            found.setdefault(entry.name, entry)
    return sorted(found.values(), key=lambda m: m.name)


def manifest_files(root: Path) -> Iterator[Path]:
    """manifests/<host>/<namespace>/<model>/<tag> files as they are now: a directory removed while it is
    walked (a delete at the same time) is passed over, never an error."""
    def entries(directory: Path, depth: int) -> Iterator[Path]:
        try:
            with os.scandir(directory) as it:
                found = [(Path(e.path), e.is_dir() if depth else e.is_file()) for e in it]
        except OSError:
            return
        for path, wanted in sorted(found):
            if wanted:
                yield from (entries(path, depth - 1) if depth else [path])
    return entries(Path(root) / "manifests", 3)


def _read_manifest(manifest: Path, root: Path, display: str) -> OllamaModel:
    # Errors name the model, never a path: where the store lies is the server's own business.
    _check_inside(manifest, root, display, "manifest")
    with open(manifest, "rb") as f:  # read and dated from one open file: a delete meanwhile is FileNotFoundError
        raw, modified = f.read(), os.fstat(f.fileno()).st_mtime
    try:
        data = json.loads(raw)
        layer = next(layer for layer in data.get("layers", [])
                     if isinstance(layer, dict) and layer.get("mediaType") == MODEL_MEDIA_TYPE)
    except (OSError, ValueError, StopIteration, AttributeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ModelError(f"model '{display}': its Ollama manifest names no model layer "
                         f"({MODEL_MEDIA_TYPE}): {why or 'none found'}") from None
    digest = str(layer.get("digest", ""))
    match = _DIGEST.fullmatch(digest)
    if not match:
        raise ModelError(f"model '{display}': its Ollama manifest's model layer digest {digest!r} is not "
                         "sha256:<64 hex>")
    blob = root / "blobs" / f"sha256-{match.group(1)}"
    if not blob.is_file():
        raise ModelError(f"model '{display}': its Ollama manifest names blob {blob.name}, which is missing; "
                         f"run `ollama pull {display}` again")
    _check_inside(blob, root, display, "model blob")
    size = layer.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        size = blob.stat().st_size
    return OllamaModel(display, blob, f"sha256:{match.group(1)}", size, modified,
                       _read_layers(data.get("layers", []), root, display), hashlib.sha256(raw).hexdigest())


def _check_inside(path: Path, root: Path, display: str, what: str) -> None:
    """A file of the store that is a link to a file outside it is not followed (as a link in the models
    directory is not): the store's files are Ollama's, written by its pulls, never links out of it."""
    if not path.resolve().is_relative_to(root.resolve()):
        raise ModelError(f"model '{display}': its {what} in Ollama's store is a link to a file outside the "
                         f"store, which is not followed; run `ollama pull {display}` again")


def _read_layers(layers: list, root: Path, display: str) -> ModelLayers:
    """The Modelfile's layers of a manifest; a layer that cannot be read is an error naming it."""
    texts: dict[str, str] = {}
    unsupported = []
    for layer in layers:
        kind = str(layer.get("mediaType", "")) if isinstance(layer, dict) else ""
        if not kind.startswith(LAYER_PREFIX) or kind == MODEL_MEDIA_TYPE:
            continue
        kind = kind[len(LAYER_PREFIX):]
        if kind in UNSUPPORTED_LAYERS:
            unsupported.append(UNSUPPORTED_LAYERS[kind])
        elif kind in ("template", "system", "params", "messages", "license"):
            texts[kind] = texts.get(kind, "") + ("\n" if kind == "license" and kind in texts else "") + \
                _layer_text(layer, root, display, kind)
    try:
        params = json.loads(texts["params"]) if "params" in texts else {}
        messages = json.loads(texts["messages"]) if "messages" in texts else []
        if not isinstance(params, dict) or not isinstance(messages, list) or \
                not all(isinstance(m, dict) for m in messages):
            raise ValueError("params must be an object and messages a list of objects")
    except ValueError as exc:
        raise ModelError(f"model '{display}': its params or messages layer is not valid JSON ({exc})") from None
    return ModelLayers(texts.get("template"), texts.get("system"), params, tuple(messages),
                       texts.get("license", ""), tuple(unsupported))


def _layer_text(layer: dict, root: Path, display: str, kind: str) -> str:
    match = _DIGEST.fullmatch(str(layer.get("digest", "")))
    if not match:
        raise ModelError(f"model '{display}': its {kind} layer's digest is not sha256:<64 hex>")
    blob = root / "blobs" / f"sha256-{match.group(1)}"
    if blob.exists():
        _check_inside(blob, root, display, f"{kind} layer")
    try:
        with open(blob, "rb") as f:
            data = f.read(MAX_LAYER_BYTES + 1)
    except OSError:
        raise ModelError(f"model '{display}': its {kind} layer is missing; run `ollama pull {display}` "
                         "again") from None
    try:
        return check_layer(kind, data)
    except ValueError as exc:
        raise ModelError(f"model '{display}': its {kind} layer {exc}") from None


def check_layer(kind: str, data: bytes) -> str:
    """A Modelfile layer's blob as its text, checked as the store is read: at most MAX_LAYER_BYTES, and for
    params and messages JSON of their shape (an object; a list of objects). ValueError says what is wrong.
    Create checks each layer it writes with it, so that no model is made that the store then cannot list."""
    if len(data) > MAX_LAYER_BYTES:
        raise ValueError(f"is over {MAX_LAYER_BYTES} bytes")
    text = data.decode("utf-8", errors="replace")
    if kind in ("params", "messages"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"is not valid JSON ({exc})") from None
        if kind == "params" and not isinstance(value, dict):
            raise ValueError("is not a JSON object")
        if kind == "messages" and not (isinstance(value, list) and all(isinstance(m, dict) for m in value)):
            raise ValueError("is not a JSON list of objects")
    return text

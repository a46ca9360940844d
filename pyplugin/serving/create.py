"""`ollama create` as Ollama's /api/create does it: a model made from a GGUF blob uploaded beforehand
(``files``: {filename: digest}) or from an existing model (``from``), with the Modelfile's template,
system, parameters, messages and license as layers of their own, written to Ollama's store; and
`ollama cp`. Progress comes as Ollama's status objects, the last one {"status": "success"}.

Everything a request gets wrong is found before the first byte is written, and said (StoreError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import ModelError, OptionsError
from ..model import GGUFFile
from ..model.vocabulary import check_vocabulary
from ..runtime import Options
from ..runtime.options import NEUTRAL
from . import ollama_store, store_write
from .catalogue import Catalogue, ModelLoadError
from .go_parse import TemplateSyntaxError
from .go_template import parsed
from .ollama_store import LAYER_PREFIX, MODEL_MEDIA_TYPE, parse_name
from .store_import import import_file
from .store_write import StoreError

TEXT_KINDS = ("template", "system", "license")
GGUF_MAGIC = b"GGUF"
FIELD_OF_LAYER = {"params": "parameters"}  # the request's field a layer is made from, where it is not its kind


@dataclass
class CreateSpec:
    """/api/create's fields, as the official clients send them."""

    model: str
    from_: str | None = None
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    quantize: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # fields pebbling does not take (modelfile, ...)


def create_model(spec: CreateSpec, catalogue: Catalogue, root: Path | None = None) -> Iterator[dict[str, Any]]:
    """Checks the request (StoreError, InvalidModelName) and returns the progress of making the model."""
    name = parse_name(spec.model)
    if spec.extra.get("modelfile"):
        raise StoreError("'modelfile' (a Modelfile's text) is not taken: send its parts as fields, as the "
                         "official clients do: 'from' or 'files', 'template', 'system', 'parameters', "
                         "'messages', 'license'")
    if spec.quantize:
        raise StoreError(f"'quantize' ({str(spec.quantize)[:20]!r}) is not supported: pebbling serves a GGUF "
                         "as it is; quantize it beforehand (llama.cpp's llama-quantize) and create from that")
    if spec.adapters:
        raise StoreError("'adapters' (LoRA) are not supported: pebbling does not serve adapters")
    if bool(spec.files) == bool(spec.from_):
        raise StoreError("send either 'files' ({filename: digest} of a GGUF uploaded with POST "
                         "/api/blobs/sha256:<hex>) or 'from' (an existing model's name), not " +
                         ("both" if spec.files else "neither"))
    new_layers = _modelfile_layers(spec)
    _check_not_hidden(spec.model, catalogue)
    if spec.files:
        source = _uploaded_gguf(spec.files, catalogue, root)
        return _run(name, new_layers, root, gguf=source)
    base = _base_model(spec.from_, catalogue, root)
    if isinstance(base, Path):
        _check_tokenizer(base, f"'from': model '{spec.from_}'")
    return _run(name, new_layers, root, base=base, details=_details(base, catalogue))


def copy_model(source: str, destination: str, catalogue: Catalogue, root: Path | None = None) -> None:
    """`destination` made a second name of the model `source` (its manifest copied, or a file of the
    models directory imported as a blob)."""
    to = parse_name(destination)
    parse_name(source)
    _check_not_hidden(destination, catalogue)
    base = _base_model(source, catalogue, root)
    if isinstance(base, ollama_store.OllamaName):
        store_write.copy_manifest(base, to, root)
        return
    for _ in _run(to, {}, root, base=base, details=_details(base, catalogue)):
        pass


def _check_not_hidden(name: str, catalogue: Catalogue) -> None:
    """Refuses a name that a file of the models directory (or the demo) already answers to: the model
    written to the store under it would never be the one served."""
    try:
        path, _ = catalogue.find(name)
    except (LookupError, ModelError):
        return
    if not any(path.parent == store / "blobs" for store in ollama_store.stores()):
        raise StoreError(f"model '{name}' is a file of the models directory (or the demo), which would hide a "
                         "model of that name in Ollama's store: choose another name")


def _modelfile_layers(spec: CreateSpec) -> dict[str, Any]:
    """The layers the request adds, by kind (license: a list of texts), each checked."""
    layers: dict[str, Any] = {}
    for kind in ("template", "system"):
        value = getattr(spec, kind)
        if value is not None:
            if not isinstance(value, str):
                raise StoreError(f"'{kind}' must be a string")
            layers[kind] = value
    if spec.template:
        try:
            parsed(spec.template)
        except TemplateSyntaxError as exc:
            raise StoreError(f"'template' is not a Go template pebbling can run: {exc}") from None
    if spec.license is not None:
        texts = [spec.license] if isinstance(spec.license, str) else spec.license
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise StoreError("'license' must be a string or a list of strings")
        layers["license"] = texts
    if spec.parameters is not None:
        if not isinstance(spec.parameters, dict):
            raise StoreError("'parameters' must be an object of options, e.g. {\"temperature\": 0.2}")
        params = {k: v for k, v in spec.parameters.items() if v is not None}
        for key, value in params.items():
            try:
                Options.from_dict({key: value})
            except OptionsError as exc:
                if key not in NEUTRAL:  # Ollama's, not applied by pebbling: kept, and /api/show says so
                    raise StoreError(f"'parameters': {exc}") from None
        layers["params"] = params
    if spec.messages is not None:
        if not isinstance(spec.messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
                and isinstance(m.get("content", ""), str) for m in spec.messages):
            raise StoreError("'messages' must be a list of {\"role\": system|user|assistant|tool, "
                             "\"content\": string}")
        layers["messages"] = [{"role": m["role"], "content": m.get("content", "")} for m in spec.messages]
    return layers


def _uploaded_gguf(files: Any, catalogue: Catalogue, root: Path | None) -> dict[str, Any]:
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise StoreError("'files' must be an object {filename: \"sha256:<hex>\"}")
    ggufs = {k: v for k, v in files.items() if k.lower().endswith(".gguf")}
    if len(files) != 1 or len(ggufs) != 1:
        raise StoreError(f"'files' names {sorted(files)[:4]}: pebbling creates a model from one GGUF file "
                         "(a name ending in .gguf); safetensors and split GGUFs are not imported")
    filename, digest = next(iter(ggufs.items()))
    blob = store_write.blob_path(digest, root)
    if not blob.is_file():
        raise StoreError(f"'files': {filename}'s blob {digest} is not on the server: upload it first with "
                         f"POST /api/blobs/{digest}")
    with open(blob, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise StoreError(f"'files': {filename} ({digest}) is not a GGUF file (no GGUF magic)")
    try:
        details = catalogue.info(blob)["details"]
    except ModelError as exc:
        raise StoreError(f"'files': {filename} cannot be read as a GGUF model: "
                         f"{str(exc).replace(str(blob), filename)}") from None
    _check_tokenizer(blob, f"'files': {filename}")
    return {"mediaType": MODEL_MEDIA_TYPE, "digest": f"sha256:{store_write.digest_hex(digest)}",
            "size": blob.stat().st_size, "details": details}


def _check_tokenizer(path: Path, shown: str) -> None:
    """Refuses a file whose tokenizer a load would refuse (check_vocabulary: a per-token array that is not
    the vocabulary's length, a merge of tokens it lacks), naming it as `shown`, never by its path."""
    try:
        with GGUFFile(path) as f:
            check_vocabulary(f.metadata, shown)
    except ModelError as exc:
        raise StoreError(str(exc)) from None


def _base_model(name: str, catalogue: Catalogue, root: Path | None) -> ollama_store.OllamaName | Path:
    """What `from` names: a manifest in the store written to, else a file (the models directory's, the
    demo, another store's blob) that is imported."""
    try:
        path, _ = catalogue.find(name)
    except LookupError:
        raise store_write.ModelNotInStore(f"model '{name}' not found") from None
    parsed = parse_name(name)
    try:
        found = ollama_store.resolve(name, store_write.store_root(root))
    except ModelError as exc:  # found a moment ago and unreadable now (its blob made a link out): a 400, as find's
        raise ModelLoadError(f"model '{name}' cannot be served: {exc}") from None
    if found is not None and found.path == path:
        return parsed
    return path


def _details(base: ollama_store.OllamaName | Path, catalogue: Catalogue) -> dict[str, Any]:
    """A file's details for the config blob (a manifest's base: its own config's)."""
    try:
        return catalogue.info(base)["details"] if isinstance(base, Path) else {}
    except (ModelError, OSError):
        return {}


def _run(name: ollama_store.OllamaName, new: dict[str, Any], root: Path | None, *,
         gguf: dict[str, Any] | None = None, base: ollama_store.OllamaName | Path | None = None,
         details: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Checks each layer the request adds as the store's reader will check it (StoreError naming the field:
    a layer the reader refuses would make a model that is never listed), then returns the progress of
    writing the model."""
    manifest = None
    if gguf is None and not isinstance(base, Path):
        manifest = store_write.read_manifest(base, root)
        if manifest is None:
            raise store_write.ModelNotInStore(f"model '{base.display}' not found")
    base_layers = [dict(layer) for layer in manifest["layers"] if isinstance(layer, dict)] if manifest else []
    params: dict[str, Any] = {}
    for layer in base_layers:
        kind = str(layer.get("mediaType", "")).removeprefix(LAYER_PREFIX)
        if kind == "params" and "params" in new:  # the new PARAMETERs over the base's, as Ollama merges them
            try:
                params = json.loads(store_write.blob_path(layer["digest"], root).read_text())
            except (OSError, ValueError, KeyError):
                params = {}
            params = params if isinstance(params, dict) else {}
    texts = [(kind, text.encode()) for kind, value in new.items() for text in _layer_texts(kind, value, params)]
    for kind, data in texts:
        try:
            ollama_store.check_layer(kind, data)
        except ValueError as exc:
            field = FIELD_OF_LAYER.get(kind, kind)
            raise StoreError(f"'{field}' makes a {kind} layer of {len(data)} bytes, which the store cannot read: "
                             f"the layer {exc}; send less") from None
    return _write(name, new, texts, root, gguf=gguf, base=base, base_layers=base_layers,
                  base_config=manifest.get("config") if manifest else None, details=details)


def _write(name: ollama_store.OllamaName, new: dict[str, Any], texts: list[tuple[str, bytes]], root: Path | None,
           *, gguf: dict[str, Any] | None, base: ollama_store.OllamaName | Path | None,
           base_layers: list[dict[str, Any]], base_config: Any, details: dict[str, Any] | None
           ) -> Iterator[dict[str, Any]]:
    catalogue_details: dict[str, Any] = details or {}
    if gguf is not None:
        yield {"status": "parsing GGUF"}
        catalogue_details = gguf.pop("details")
        layers = [gguf]
    elif isinstance(base, Path):
        yield {"status": f"importing {base.name if not base.name.startswith('sha256-') else 'model'}"}
        layers = [{"mediaType": MODEL_MEDIA_TYPE, **import_file(base, root)}]
    else:
        layers = base_layers
        if isinstance(base_config, dict):
            catalogue_details = _config_details(base_config, root)
    kept = []
    for layer in layers:
        if str(layer.get("mediaType", "")).removeprefix(LAYER_PREFIX) in new:
            continue
        yield {"status": f"using existing layer {layer.get('digest')}"}
        kept.append(layer)
    added = []
    for kind, data in texts:
        layer = {"mediaType": LAYER_PREFIX + kind, **store_write.write_blob(data, root)}
        yield {"status": f"creating new layer {layer['digest']}"}
        added.append(layer)
    layers = kept + added
    config = store_write.config_layer(catalogue_details, layers, root)
    yield {"status": "writing manifest"}
    store_write.write_manifest(name, layers, config, root)
    yield {"status": "success"}


def _layer_texts(kind: str, value: Any, base_params: dict[str, Any]) -> list[str]:
    """The blobs' texts of one kind of layer: a license may be several; params and messages are JSON."""
    if kind == "license":
        return value
    if kind == "params":
        return [json.dumps({**base_params, **value})]
    return [json.dumps(value)] if kind == "messages" else [value]


def _config_details(config: dict[str, Any], root: Path | None) -> dict[str, Any]:
    try:
        data = json.loads(store_write.blob_path(config["digest"], root).read_text())
    except (OSError, ValueError, KeyError, StoreError):
        return {}
    return {"format": data.get("model_format", "gguf"), "family": data.get("model_family", ""),
            "families": data.get("model_families") or [], "parameter_size": data.get("model_type", ""),
            "quantization_level": data.get("file_type", "")}

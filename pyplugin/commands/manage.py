"""`pebbling create NAME -f Modelfile`, `cp SOURCE DESTINATION`, `rm NAME...` and `push NAME`: a running
`pebbling serve` makes, copies and deletes models in Ollama's store, as `ollama` asks `ollama serve` to.

create reads the Modelfile as Ollama reads it (pyplugin/serving/modelfile_text.py). Its FROM is a GGUF file
(a path relative to the Modelfile's directory, or absolute, or under ~), uploaded as a blob unless the
server has it already; a blob (sha256:<hex>) the server has; or a model's name.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from ..errors import PebblingError
from ..serving.modelfile_text import Modelfile, ModelfileError, parse
from .client import Client, ServerError

_SERVER = "Asks the pebbling server (pebbling serve) on $PEBBLING_HOST (default 127.0.0.1:11435)."
_BLOB = re.compile(r"@?sha256[:-]([0-9a-f]{64})")
GGUF_MAGIC = b"GGUF"
CHUNK = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("create", help="create a model from a Modelfile",
                              description="Create the model NAME from a Modelfile, as ollama create does: FROM a "
                                          "GGUF file (uploaded), a blob sha256:<hex> or a model; PARAMETER, "
                                          "TEMPLATE, SYSTEM, MESSAGE and LICENSE as its layers. " + _SERVER)
    p.add_argument("model", metavar="NAME", help="the new model's name, e.g. mario or me/mario:v1")
    p.add_argument("-f", "--file", type=Path, default=Path("Modelfile"),
                   help="the Modelfile (default: ./Modelfile)")
    p.add_argument("-q", "--quantize", metavar="TYPE",
                   help="not supported: pebbling serves a GGUF as it is (the server says so)")
    p.set_defaults(func=create)
    p = subparsers.add_parser("cp", help="copy a model", description="Give the model SOURCE a second name. " + _SERVER)
    p.add_argument("source", help="a model's name, as pebbling list shows it")
    p.add_argument("destination", help="the new name")
    p.set_defaults(func=copy)
    p = subparsers.add_parser("rm", help="remove models",
                              description="Delete models from Ollama's store (and the blobs only they used). "
                                          + _SERVER)
    p.add_argument("models", nargs="+", metavar="NAME", help="a model's name, as pebbling list shows it")
    p.set_defaults(func=remove)
    p = subparsers.add_parser("push", help="not supported: pebbling does not publish models",
                              description="Not supported: pebbling does not publish models to a registry. Push "
                                          "with Ollama (ollama push NAME), which reads the same store.")
    p.add_argument("model", metavar="NAME", help="a model's name")
    p.set_defaults(func=push)


def create(args: argparse.Namespace) -> int:
    modelfile = read_modelfile(args.file)
    client = Client()
    try:
        body: dict[str, Any] = {"model": args.model, **source(client, modelfile.from_, args.file.parent),
                                **layers(modelfile)}
        if args.quantize:
            body["quantize"] = args.quantize
        for progress in client.stream("/api/create", body):
            print(progress.get("status", ""), file=sys.stderr)
    finally:
        client.close()
    return 0


def copy(args: argparse.Namespace) -> int:
    _ask(lambda c: c.send("POST", "/api/copy", {"source": args.source, "destination": args.destination}))
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def remove(args: argparse.Namespace) -> int:
    def delete(client: Client) -> None:
        for name in args.models:
            # As ollama rm: the model is unloaded first (a request with keep_alive 0 that loads nothing), so
            # that a deleted model does not stay in memory and in `pebbling ps`.
            try:
                client.post("/api/generate", {"model": name, "keep_alive": 0})
            except ServerError as exc:
                if "not found" not in str(exc).lower():
                    print(f"warning: unable to stop model '{name}': {exc}", file=sys.stderr)
            client.send("DELETE", "/api/delete", {"model": name})
            print(f"deleted '{name}'")

    _ask(delete)
    return 0


def push(args: argparse.Namespace) -> int:
    raise PebblingError(f"push is not supported: pebbling does not publish models to a registry; push "
                        f"{args.model} with Ollama (ollama push {args.model}), which reads the same store")


# ---------------------------------------------------------------------------------------------------
# a Modelfile into /api/create's fields


def read_modelfile(path: Path) -> Modelfile:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PebblingError(f"{path}: no such Modelfile; name one with -f FILE") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PebblingError(f"{path}: cannot be read as a Modelfile (UTF-8 text): {exc}") from None
    try:
        return parse(text)
    except ModelfileError as exc:
        raise ModelfileError(f"{path}: {exc}") from None


def layers(modelfile: Modelfile) -> dict[str, Any]:
    """The Modelfile's layers as /api/create's fields: only those it gives (a model FROM another keeps the
    rest of that one's)."""
    fields: dict[str, Any] = {}
    if modelfile.template is not None:
        fields["template"] = modelfile.template
    if modelfile.system is not None:
        fields["system"] = modelfile.system
    if modelfile.parameters:
        fields["parameters"] = modelfile.parameters
    if modelfile.messages:
        fields["messages"] = modelfile.messages
    if modelfile.licenses:
        fields["license"] = modelfile.licenses
    return fields


def source(client: Client, given: str, directory: Path) -> dict[str, Any]:
    """FROM as /api/create takes it: {"files": {name: digest}} for a file (uploaded unless the server has
    it) or a blob, {"from": name} for a model; as Ollama, a file is looked for first."""
    path = Path(given).expanduser()
    path = path if path.is_absolute() else directory / path
    if path.is_dir():
        raise PebblingError(f"FROM {given}: a directory; pebbling creates a model from one GGUF file "
                            "(safetensors directories are not imported: convert them to GGUF first)")
    if path.is_file():
        digest = upload(client, path)
        return {"files": {path.name if path.name.endswith(".gguf") else "model.gguf": digest}}
    if given.startswith((".", "/", "~")) or given.lower().endswith(".gguf"):  # meant as a file
        raise PebblingError(f"FROM {given}: no such file ({path}); a relative path is the Modelfile's "
                            "directory's")
    blob = _BLOB.fullmatch(given)
    if blob:
        digest = f"sha256:{blob.group(1)}"
        if not client.has_blob(digest):
            raise PebblingError(f"FROM {given}: the server has no such blob; FROM the GGUF file instead, "
                                "which is uploaded")
        return {"files": {"model.gguf": digest}}
    return {"from": given}


def upload(client: Client, path: Path) -> str:
    """The digest of the GGUF file `path`, uploaded to the server as a blob unless it has it already."""
    with open(path, "rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise PebblingError(f"FROM {path}: not a GGUF file (no GGUF magic); pebbling creates models from "
                                "GGUF files")
    print("gathering model components", file=sys.stderr)
    digest = f"sha256:{sha256_of(path)}"
    if not client.has_blob(digest):
        client.upload_blob(digest, _chunks(path))
    print(f"copying file {digest} 100%", file=sys.stderr)
    return digest


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    for chunk in _chunks(path):
        h.update(chunk)
    return h.hexdigest()


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def _ask(call):
    client = Client()
    try:
        return call(client)
    finally:
        client.close()

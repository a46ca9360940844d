"""Where `run` sends its requests: a running `pebbling serve` (Remote) or an Engine in this process
(Local). Both take the bodies of Ollama's /api/chat and /api/generate and yield the server's NDJSON
items, so the chat loop, the flags and the printing are one code path whichever answers, and the
same greedy text comes back from both (the server runs the same Engine).
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import Any, Iterator

from ..errors import ModelError
from ..serving import Engine, Final, GenerationRequest, ModelLayers, ModelNotFoundError, ollama_store
from .client import Client


class Remote:
    """A `pebbling serve` that answered on $PEBBLING_HOST."""

    def __init__(self, client: Client):
        self.client = client
        self.where = client.address.url

    def show(self, model: str) -> dict[str, Any]:
        return self.client.post("/api/show", {"model": model})

    def chat(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.client.stream("/api/chat", {**body, "stream": True})

    def generate(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.client.stream("/api/generate", {**body, "stream": True})

    def close(self) -> None:
        self.client.close()


class _LocalEngine(Engine):
    """The server's Engine, except that a path to a GGUF file on this machine is a model name too:
    the person at the terminal may name their own files; the server takes names only from the network.
    Every other name resolves through the server's catalogue."""

    def find(self, name: str) -> tuple[Path, ModelLayers]:
        path = Path(name).expanduser()
        if path.is_file():
            return path, ModelLayers()
        if looks_like_path(name):
            what = "is a directory, not a GGUF file" if path.is_dir() else "does not exist"
            raise ModelNotFoundError(f"model file {name} {what}")
        try:
            return super().find(name)
        except ModelNotFoundError as exc:
            # The server names no directories to its clients; the person at this terminal is told
            # where the name was looked for (the registry's own message), as `estimate` tells them.
            looked = str(exc.__cause__) if isinstance(exc.__cause__, ModelError) else str(exc)
            if "/" in name:  # not a path (above): a namespaced name, which only Ollama's store can hold
                where = ", ".join(str(p) for p in ollama_store.stores())
                looked = (f"model {name!r} not found in Ollama's local store ({where}; set $OLLAMA_MODELS to "
                          "look elsewhere)")
            raise ModelNotFoundError(looked) from None


def looks_like_path(name: str) -> bool:
    """Whether `name` was meant as a file rather than a model name: absolute, relative to . or ~, or a
    .gguf file name (me/mario:7b is a name; ./mario.gguf and /models/mario.gguf are paths)."""
    return name.startswith(("/", "./", "../", "~")) or name.lower().endswith(".gguf") or \
        (os.sep != "/" and os.sep in name)


class Local:
    """An Engine in this process: the model loads on the first request and stays as long as this
    process (a chat left idle does not lose it), unless a request's keep_alive says otherwise."""

    where = "this process"

    def __init__(self, backend: str | None = None):
        self.engine = _LocalEngine(backend=backend, default_keep_alive=math.inf)

    def show(self, model: str) -> dict[str, Any]:
        listing, extra = self.engine.show(model)
        modified = datetime.datetime.fromtimestamp(listing.modified, datetime.timezone.utc).isoformat()
        return {**extra, "details": listing.details, "modified_at": modified}

    def chat(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        request = GenerationRequest(model=body["model"], messages=body.get("messages", []),
                                    options=body.get("options") or {}, keep_alive=body.get("keep_alive"),
                                    format=body.get("format"))
        return self._items(request, lambda text: {"message": {"role": "assistant", "content": text}})

    def generate(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        request = GenerationRequest(model=body["model"], prompt=body.get("prompt", ""), system=body.get("system"),
                                    raw=bool(body.get("raw")), options=body.get("options") or {},
                                    keep_alive=body.get("keep_alive"), format=body.get("format"))
        return self._items(request, lambda text: {"response": text})

    def _items(self, request: GenerationRequest, piece) -> Iterator[dict[str, Any]]:
        job = self.engine.submit(request)  # a bad request is refused here, before the first item
        return self._stream(job, piece)

    @staticmethod
    def _stream(job, piece) -> Iterator[dict[str, Any]]:
        try:
            for item in job:
                if isinstance(item, Final):
                    yield {**piece(""), "done": True, "done_reason": item.done_reason, **item.stats(),
                           "pebbling": item.report}
                else:
                    yield {**piece(item), "done": False}
        finally:  # Ctrl-C, or the reader stopped early: the generation stops at its next token
            job.cancel()

    def close(self) -> None:
        self.engine.close()

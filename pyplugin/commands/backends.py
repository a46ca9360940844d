"""Where `run` sends its requests: a running `pebbling serve` (Remote) or an Engine in this process
(Local). Both take the bodies of Ollama's /api/chat and /api/generate and yield the server's NDJSON
items, so the chat loop, the flags and the printing are one code path whichever answers, and the
same greedy text comes back from both (the server runs the same Engine).
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any, Iterator

from ..serving import Engine, Final, GenerationRequest, ModelLayers
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
        return super().find(name)


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

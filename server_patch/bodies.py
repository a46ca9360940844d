"""Request bodies: a size limit, JSON whatever the Content-Type, a cap on nesting, lone surrogates read as
Go reads them. Blob uploads (/api/blobs/:digest) pass through untouched: they stream to disk as they come
(model_admin.py), whatever their size."""

from __future__ import annotations

import re

import numpy as np

from .errors import error_response

STREAMED_UPLOADS = "/api/blobs/"  # the path prefix of bodies that are not buffered




class BodyLimit:
    """Buffers each request body up to `max_bytes` (413 beyond it) and marks POST and DELETE bodies as JSON.

    Ollama reads every body as JSON, and `curl -d` sends application/x-www-form-urlencoded, which
    FastAPI would not parse; so those bodies are declared JSON here.
    """

    _DRAIN_LIMIT = 64 << 20  # read (and drop) at most this much of an oversized body before answering

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith(STREAMED_UPLOADS):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"0")
        too_large = not declared.isdigit() or int(declared) > self.max_bytes
        body, received, more = bytearray(), 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            more = message.get("more_body", False)
            if received > self.max_bytes:
                too_large = True
            if too_large:
                # Reading the rest lets the client see the 413 instead of a reset connection.
                if received > self._DRAIN_LIMIT:
                    break
                continue
            body += chunk
        if too_large:
            limit = f"{self.max_bytes} bytes ({self.max_bytes / 2**20:g} MiB)"
            response = error_response(scope["path"], 413, f"the request body is larger than the limit "
                                                          f"of {limit}; send a shorter prompt")
            return await response(scope, receive, send)

        if json_too_deep(bytes(body)):
            return await error_response(scope["path"], 400, f"the request body's JSON nests arrays and objects "
                                                            f"more than {MAX_JSON_DEPTH} deep; send at most "
                                                            f"{MAX_JSON_DEPTH} levels")(scope, receive, send)
        if _SURROGATE_ESCAPE.search(body):
            body = _without_lone_surrogates(bytes(body))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, for handlers that watch it

        if scope["method"] in ("POST", "DELETE"):  # DELETE: /api/delete's body
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        await self.app(scope, replay, send)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# An escaped backslash, a valid surrogate pair, or a lone surrogate: matched left to right, so the escape
# after an escaped backslash ("\\\\ud800" is a backslash and the text "ud800") is never taken for one.
_ESCAPE_OR_SURROGATE = re.compile(rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                                  rb"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _without_lone_surrogates(body: bytes) -> bytes:
    """The body with each lone UTF-16 surrogate escape (\\ud800 without its pair) read as U+FFFD, as
    Go's JSON decoder (and so Ollama) reads it: Python would keep it, and no text can be encoded with
    one in it. Rewritten in the text itself, so no nesting depth can make it recurse."""
    return _ESCAPE_OR_SURROGATE.sub(lambda m: m[0] if len(m[0]) in (2, 12) else rb"\ufffd", body)


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
MAX_JSON_DEPTH = 256  # arrays and objects in a request body: far past any schema, tool or message list


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays and objects more than `limit` deep (brackets inside strings are
    not counted). Counted with numpy over the bytes, so an 8 MiB body costs milliseconds."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    structure = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    steps = np.zeros(structure.shape, dtype=np.int32)
    steps[(structure == ord("[")) | (structure == ord("{"))] = 1
    steps[(structure == ord("]")) | (structure == ord("}"))] = -1
    return bool(steps.size) and int(np.cumsum(steps).max()) > limit

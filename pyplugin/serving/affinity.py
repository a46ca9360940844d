"""Which conversation a request continues, so that a router in front of several servers can send it
where its KV cache already is.

A request is reduced to a chain of keys, one per block of its conversation so far: a chat request's
blocks are its messages, a completion's are 32-character pieces of its prompt (or of the `context`
tokens an Ollama /api/generate turn carries back). Each key hashes the model and every block up to its
own, so a request whose conversation starts with a previous request's shares that request's keys, and
its longest shared key names the server that last held the conversation. An explicit session header
(`X-Pebbling-Session`) replaces the chain with one key, for any model and route. A prompt shorter than one block, without a
session header, has no key and goes to the least loaded server.

Nothing here knows of a cluster: `ConversationTable` maps keys to whatever names a server.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Hashable, Iterable

SESSION_HEADER = "x-pebbling-session"
TEXT_BLOCK = 32          # characters per key of a completion's prompt
MAX_KEYS = 100_000       # keys remembered, least recently used forgotten first

# The routes whose bodies carry a conversation, and where in the body it is.
CHAT_PATHS = ("/api/chat", "/v1/chat/completions")
PROMPT_PATHS = ("/api/generate", "/v1/completions")


def conversation_keys(path: str, body: bytes, session: str | None = None) -> list[str]:
    """The request's keys, shortest conversation first; [] where it carries none that can be followed."""
    try:
        request = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        request = None
    if session:  # one user's session, whatever the model: where its other models' state is too
        return [_digest(b"session\0" + session.encode())]
    model = request.get("model") if isinstance(request, dict) else None
    if not isinstance(model, str):
        return []
    if path in CHAT_PATHS and isinstance(request.get("messages"), list):
        blocks = [json.dumps(m, sort_keys=True, ensure_ascii=False) for m in request["messages"]]
    elif path in PROMPT_PATHS:
        blocks = _text_blocks(request)
    else:
        return []
    return list(_chain(model, blocks))


def _text_blocks(request: dict) -> list[str]:
    context = request.get("context")
    if isinstance(context, list) and context:  # an Ollama generate turn: the tokens so far lead
        text = "ctx:" + ",".join(str(t) for t in context) + ";"
    else:
        text = f"{request.get('system') or ''}\0{request.get('prompt') or ''}"
    return [text[i:i + TEXT_BLOCK] for i in range(0, len(text) - TEXT_BLOCK + 1, TEXT_BLOCK)]


def _chain(model: str, blocks: Iterable[str]):
    state = hashlib.blake2b(model.encode(), digest_size=16)
    for block in blocks:
        state.update(b"\0" + block.encode("utf-8", "surrogatepass"))
        yield state.copy().hexdigest()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class ConversationTable:
    """Key -> the server that last answered a request with that key; thread-safe, bounded."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self._owner: OrderedDict[str, Hashable] = OrderedDict()
        self._lock = threading.Lock()

    def owner(self, keys: list[str]) -> Hashable | None:
        """The server of the longest known key, or None."""
        with self._lock:
            for key in reversed(keys):
                if key in self._owner:
                    self._owner.move_to_end(key)
                    return self._owner[key]
        return None

    def record(self, keys: list[str], server: Hashable) -> None:
        with self._lock:
            for key in keys:
                self._owner[key] = server
                self._owner.move_to_end(key)
            while len(self._owner) > self.max_keys:
                self._owner.popitem(last=False)

    def forget(self, server: Hashable) -> None:
        """Drops a server that is gone: its conversations start over wherever they land next."""
        with self._lock:
            for key in [k for k, s in self._owner.items() if s == server]:
                del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)

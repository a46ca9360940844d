"""A registry speaking Ollama's protocol (the OCI distribution API's GETs) on loopback, for the pull tests:
manifests by name and tag, blobs by digest with Range requests, and ways to misbehave on purpose: a
download cut off half-way, a blob whose bytes are not its digest's, a body longer or shorter than the
blob, an endless body, a body sent slowly (in pieces, or a byte at a time) or never (its headers, then
nothing), a redirect to another host name (`localhost` for `127.0.0.1`). Every misbehaviour stops when the
registry does."""

from __future__ import annotations

import hashlib
import json
import re
import select
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

MODEL = "application/vnd.ollama.image.model"


@dataclass
class Registry:
    manifests: dict[tuple[str, str, str], bytes] = field(default_factory=dict)  # (namespace, model, tag)
    blobs: dict[str, bytes] = field(default_factory=dict)                         # "sha256:<hex>" -> bytes
    cut: dict[str, int] = field(default_factory=dict)       # digest -> how many more responses to cut short
    corrupt: set[str] = field(default_factory=set)          # digests served with one byte changed
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    extra: dict[str, bytes] = field(default_factory=dict)   # digest -> bytes sent after the blob's
    short: dict[str, int] = field(default_factory=dict)     # digest -> the byte where every body of it ends
    endless: set[str] = field(default_factory=set)          # digests whose body never ends (chunked)
    pieces: dict[str, tuple[int, float]] = field(default_factory=dict)  # digest -> (pieces, seconds between)
    drip: dict[str, float] = field(default_factory=dict)    # digest -> seconds between single bytes
    stall: set[str] = field(default_factory=set)            # digests answered with headers and then nothing
    redirect: set[str] = field(default_factory=set)         # digests answered 307 to the same path on localhost
    stopped: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def add(self, namespace: str, model: str, tag: str, layers: dict[str, bytes]) -> dict[str, str]:
        """A model whose layers are {kind: bytes} (kind "model" is the GGUF); returns {kind: digest}."""
        entries, digests = [], {}
        for kind, data in layers.items():
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            self.blobs[digest] = data
            digests[kind] = digest
            entries.append({"mediaType": f"application/vnd.ollama.image.{kind}", "digest": digest,
                            "size": len(data)})
        config = json.dumps({"model_format": "gguf"}).encode()
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        self.blobs[config_digest] = config
        self.manifests[(namespace, model, tag)] = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": config_digest,
                       "size": len(config)},
            "layers": entries}).encode()
        return digests

    def add_manifest(self, namespace: str, model: str, tag: str, manifest: dict) -> None:
        """A manifest as given (layers naming blobs added with `add`, or any other)."""
        self.manifests[(namespace, model, tag)] = json.dumps(manifest).encode()

    def blob_gets(self, digest: str) -> int:
        return len(self.ranges(digest))

    def ranges(self, digest: str) -> list[str | None]:
        return [r for path, r in self.requests if path.endswith(f"/blobs/{digest}")]


_MANIFEST = re.compile(r"/v2/([^/]+)/([^/]+)/manifests/([^/]+)")
_BLOB = re.compile(r"/v2/([^/]+)/([^/]+)/blobs/(sha256:[0-9a-f]{64})")
_RANGE = re.compile(r"bytes=(\d+)-")


def _handler(registry: Registry):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            registry.requests.append((self.path, self.headers.get("Range")))
            if m := _MANIFEST.fullmatch(self.path):
                body = registry.manifests.get(m.groups())
                if body is None:
                    return self._send(404, json.dumps({"errors": [{"code": "MANIFEST_UNKNOWN"}]}).encode())
                return self._send(200, body, "application/vnd.docker.distribution.manifest.v2+json")
            if (m := _BLOB.fullmatch(self.path)) and m.group(3) in registry.blobs:
                digest = m.group(3)
                data = registry.blobs[digest]
                if digest in registry.corrupt:
                    data = bytes([data[0] ^ 1]) + data[1:]
                if digest in registry.redirect and not self.headers.get("Host", "").startswith("localhost"):
                    self.send_response(307)
                    self.send_header("Location", f"http://localhost:{self.server.server_address[1]}{self.path}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if digest in registry.endless:
                    return self._endless()
                if digest in registry.stall:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.flush()
                    while not registry.stopped.wait(0.2):
                        if select.select([self.connection], [], [], 0)[0]:  # the client closed the connection
                            break
                    self.close_connection = True
                    return
                start = 0
                if (r := _RANGE.fullmatch(self.headers.get("Range") or "")) is not None:
                    start = int(r.group(1))
                part = data[start:] + registry.extra.get(digest, b"")
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(part)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if digest in registry.short:
                    self.wfile.write(part[:max(0, registry.short[digest] - start)])
                    self.close_connection = True
                    return
                if digest in registry.pieces or digest in registry.drip:
                    return self._slowly(part, *registry.pieces.get(digest, (len(part), registry.drip.get(digest))))
                if registry.cut.get(digest, 0) > 0:  # half of it, then the connection goes
                    registry.cut[digest] -= 1
                    self.wfile.write(part[:len(part) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(part)
                return
            self._send(404, b'{"errors": [{"code": "BLOB_UNKNOWN"}]}')

        def _slowly(self, part: bytes, pieces: int, pause: float):
            step = max(1, -(-len(part) // pieces))
            try:
                for i in range(0, len(part), step):
                    if registry.stopped.wait(pause if i else 0):
                        break
                    self.wfile.write(part[i:i + step])
                    self.wfile.flush()
            except OSError:  # the client left
                pass
            self.close_connection = True

        def _endless(self):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"\0" * 65536
            try:
                while not registry.stopped.is_set():
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the client left
                pass
            self.close_connection = True

        def _send(self, status: int, body: bytes, kind: str = "application/json"):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that left is no error here
            super().handle_error(request, client_address)


@contextmanager
def serving_registry() -> Iterator[Registry]:
    registry = Registry()
    server = _Server(("127.0.0.1", 0), _handler(registry))
    registry.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield registry
    finally:
        registry.stopped.set()
        server.shutdown()
        server.server_close()

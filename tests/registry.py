"""A registry speaking Ollama's protocol (the OCI distribution API's GETs) on loopback, for the pull tests:
manifests by name and tag, blobs by digest with Range requests, and ways to misbehave on purpose (a
download cut off half-way, a blob whose bytes are not its digest's)."""

from __future__ import annotations

import hashlib
import json
import re
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
                start = 0
                if (r := _RANGE.fullmatch(self.headers.get("Range") or "")) is not None:
                    start = int(r.group(1))
                part = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(part)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if registry.cut.get(digest, 0) > 0:  # half of it, then the connection goes
                    registry.cut[digest] -= 1
                    self.wfile.write(part[:len(part) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(part)
                return
            self._send(404, b'{"errors": [{"code": "BLOB_UNKNOWN"}]}')

        def _send(self, status: int, body: bytes, kind: str = "application/json"):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@contextmanager
def serving_registry() -> Iterator[Registry]:
    registry = Registry()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(registry))
    server.daemon_threads = True
    registry.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield registry
    finally:
        server.shutdown()
        server.server_close()

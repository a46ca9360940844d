"""Who may talk to the server: the Host and Origin checks Ollama makes, and CORS for the origins allowed.

A server on loopback answers only requests addressed to a loopback name (`Host`), so that a web page
cannot reach it through DNS rebinding; and a browser's request from a page whose `Origin` is not
allowed is refused before it does anything, so that any web page a user visits cannot drive it.
Clients that are not browsers (curl, the SDKs) send no Origin and are not affected.

- PEBBLING_ORIGINS: more allowed origins, comma-separated, `*` as a wildcard (e.g. `https://app.example`,
  `chrome-extension://*`, or `*` for any), as OLLAMA_ORIGINS.
- PEBBLING_HOST: the address `pebbling serve` listens on (as OLLAMA_HOST); bound beyond loopback, the
  server answers any Host, since it is then meant to be reached by other names.
"""

from __future__ import annotations

import fnmatch
import os
import re

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from pyplugin.serving import HOST_ENV, ORIGINS_ENV, is_loopback
LOCAL_ORIGINS = tuple(f"{scheme}://{host}{port}" for scheme in ("http", "https")
                      for host in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0") for port in ("", ":*"))
APP_ORIGINS = ("app://*", "file://*", "tauri://*", "vscode-webview://*")  # desktop apps, as Ollama allows


def allowed_origins() -> list[str]:
    extra = [o.strip() for o in os.environ.get(ORIGINS_ENV, "").split(",") if o.strip()]
    return [*LOCAL_ORIGINS, *APP_ORIGINS, *extra]


def _host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """Refuses (403, JSON) requests whose Host is not a loopback name while the server listens on
    loopback, and browser requests from an origin not allowed; answers CORS for the allowed ones."""

    def __init__(self, app):
        origins = allowed_origins()
        self._origin = re.compile("|".join(f"(?:{fnmatch.translate(o)})" for o in origins), re.IGNORECASE)
        bind = os.environ.get(HOST_ENV, "").strip()
        self._check_host = not bind or is_loopback(_host_name(bind))
        self._cors = CORSMiddleware(app, allow_origin_regex=self._origin.pattern, allow_methods=["*"],
                                    allow_headers=["*"])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self._cors(scope, receive, send)
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in (b"host", b"origin")}
        host, origin = headers.get("host"), headers.get("origin")
        if self._check_host and host is not None and not is_loopback(_host_name(host)):
            return await _refuse(scope, receive, send, f"Host {host[:80]!r} is not a loopback name; this "
                                 f"server listens on loopback only (set {HOST_ENV} to listen beyond it)")
        if origin is not None and not self._origin.fullmatch(origin):
            return await _refuse(scope, receive, send, f"requests from origin {origin[:80]!r} are not allowed; "
                                 f"add it to {ORIGINS_ENV} (comma-separated, * as a wildcard) to allow them")
        await self._cors(scope, receive, send)


async def _refuse(scope, receive, send, message: str) -> None:
    body = ({"error": {"message": message, "type": "permission_error", "param": None, "code": None}}
            if scope["path"].startswith("/v1/") else {"error": message})
    await JSONResponse(body, status_code=403)(scope, receive, send)

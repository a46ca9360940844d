"""Who may talk to the server: the Host and Origin checks Ollama makes, and CORS for the origins allowed.

A server on loopback answers only requests addressed to a loopback name (`Host`), so that a web page
cannot reach it through DNS rebinding; and a browser's request from a page whose `Origin` is not
allowed is refused before it does anything, so that any web page a user visits cannot drive it.
Clients that are not browsers (curl, the SDKs) send no Origin and are not affected.

- PEBBLING_ORIGINS: more allowed origins, comma-separated, `*` as a wildcard (e.g. `https://app.example`,
  `chrome-extension://*`, or `*` for any), as OLLAMA_ORIGINS.
- PEBBLING_HOST: the address `pebbling serve` listens on (as OLLAMA_HOST); bound beyond loopback, the
  server answers any Host, since it is then meant to be reached by other names.

Hosts and origins are parsed, not matched as text: a Host is `name[:port]` (any case, a trailing dot
allowed), an Origin `scheme://name[:port]`; anything else (`localhost:80@evil.com`, a path, user info)
is refused. On loopback the Host names allowed are Ollama's loopback ones: empty, `localhost` and
`*.localhost`, and loopback or unspecified addresses (127.0.0.1, [::1], 0.0.0.0). Deliberately stricter
than Ollama: private addresses, this machine's own name and `*.local` / `*.internal` names are refused,
since a server on loopback is never reached by them and such names can be pointed elsewhere. Allowed
origins compare case-insensitively, with `*` the only wildcard (so `http://[::1]:*` means itself).
"""

from __future__ import annotations

import ipaddress
import os
import re

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from pyplugin.serving import HOST_ENV, ORIGINS_ENV, is_loopback
LOCAL_ORIGINS = tuple(f"{scheme}://{host}{port}" for scheme in ("http", "https")
                      for host in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0") for port in ("", ":*"))
APP_ORIGINS = ("app://*", "file://*", "tauri://*", "vscode-webview://*")  # desktop apps, as Ollama allows

# name[:port]: a DNS name or an IPv4 address, or an IPv6 address in brackets; nothing else.
_HOST = re.compile(r"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*)(?::(?P<port>[0-9]{1,5}))?")
_ORIGIN = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<host>" + _HOST.pattern + ")")


def allowed_origins() -> list[str]:
    extra = [o.strip() for o in os.environ.get(ORIGINS_ENV, "").split(",") if o.strip()]
    return [*LOCAL_ORIGINS, *APP_ORIGINS, *extra]


def origin_pattern(origins: list[str]) -> str:
    """One case-insensitive regex for the allowed origins: each literal but for `*`, which matches
    anything (the Origin is checked to be well formed first, so `*` cannot reach past its part)."""
    return "(?i)" + "|".join(f"(?:{'.*'.join(re.escape(part) for part in o.split('*'))})" for o in origins)


def host_name(header: str) -> str | None:
    """The name in a Host header, lower case, without its port, brackets or trailing dot ("[::1]:8080" ->
    "::1", "LOCALHOST.:80" -> "localhost"); None if the header is not `name[:port]`."""
    m = _HOST.fullmatch(header.strip())
    if m is None:
        try:  # an IPv6 address without brackets, which Ollama (Go's SplitHostPort) reads whole
            return str(ipaddress.IPv6Address(header.strip()))
        except ValueError:
            return None
    name = m["name"].lower()
    name = name[1:-1] if name.startswith("[") else name
    return name[:-1] if name.endswith(".") and not name.endswith("..") else name


def loopback_host(header: str) -> bool:
    """Whether a Host header names this machine's loopback, as Ollama's allowedHost judges it for a server
    on loopback (empty counts), less the names a loopback server is never reached by (see above)."""
    name = host_name(header)
    if name is None:
        return False
    if name == "" and header.strip() == "":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return bool(name) and is_loopback(name)
    return address.is_loopback or address.is_unspecified


def well_formed_origin(origin: str) -> bool:
    m = _ORIGIN.fullmatch(origin)
    return m is not None and host_name(m["host"]) is not None


class RequestGuard:
    """Refuses (403, JSON) requests whose Host is not a loopback name while the server listens on
    loopback, and browser requests from an origin not allowed; answers CORS for the allowed ones."""

    def __init__(self, app):
        pattern = origin_pattern(allowed_origins())
        self._origin = re.compile(pattern)
        bind = os.environ.get(HOST_ENV, "").strip()
        self._check_host = not bind or is_loopback(host_name(bind) or bind)
        self._cors = CORSMiddleware(app, allow_origin_regex=pattern, allow_methods=["*"], allow_headers=["*"])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self._cors(scope, receive, send)
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in (b"host", b"origin")}
        host, origin = headers.get("host"), headers.get("origin")
        if self._check_host and host is not None and not loopback_host(host):
            return await _refuse(scope, receive, send, f"Host {host[:80]!r} is not a loopback name; this "
                                 f"server listens on loopback only (set {HOST_ENV} to listen beyond it)")
        if origin is not None and not (well_formed_origin(origin) and self._origin.fullmatch(origin)):
            return await _refuse(scope, receive, send, f"requests from origin {origin[:80]!r} are not allowed; "
                                 f"add it to {ORIGINS_ENV} (comma-separated, * as a wildcard) to allow them")
        await self._cors(scope, receive, send)


async def _refuse(scope, receive, send, message: str) -> None:
    body = ({"error": {"message": message, "type": "permission_error", "param": None, "code": None}}
            if scope["path"].startswith("/v1/") else {"error": message})
    await JSONResponse(body, status_code=403)(scope, receive, send)

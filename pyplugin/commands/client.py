"""Where `pebbling serve` listens, read from $PEBBLING_HOST as Ollama reads $OLLAMA_HOST, and a small
client for its Ollama API. `run` uses it when a server answers; `list`, `ps`, `show`, `stop`, `create`,
`cp` and `rm` always do.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

import httpx

from ..errors import PebblingError
from ..serving.settings import HOST_ENV

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11435  # beside Ollama's 11434, so both can run
PROBE_SECONDS = 0.5   # how long `run` waits to hear whether a server answers before loading in-process


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str
    port: int
    path: str = ""

    @property
    def url(self) -> str:
        """Where a client dials: a server listening on every address (0.0.0.0, ::) is on this machine."""
        host = _reachable(self.host)
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def parse_host(text: str | None) -> Address:
    """An address as $OLLAMA_HOST accepts one: `host`, `host:port`, `:port`, `[::1]:port` or a URL
    (http:// defaults to port 80, https:// to 443, a bare host to 11435). Empty: 127.0.0.1:11435."""
    text = (text or "").strip().strip("\"'")
    scheme, sep, rest = text.partition("://")
    default_port = DEFAULT_PORT
    if not sep:
        scheme, rest = "http", text
    elif scheme in ("http", "https"):
        default_port = 80 if scheme == "http" else 443
    else:
        raise PebblingError(f"${HOST_ENV} is {text!r}: the scheme {scheme!r} is not served; accepted: host, "
                            "host:port, http://host:port or https://host:port")
    hostport, slash, path = rest.partition("/")
    path = f"/{path}".rstrip("/") if slash else ""
    host, port = hostport, str(default_port)
    if hostport.startswith("["):  # [v6] or [v6]:port
        inside, _, after = hostport[1:].partition("]")
        host, port = inside, after[1:] if after.startswith(":") else port
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise PebblingError(f"${HOST_ENV} is {text!r}: port {port!r} is not a port; accepted: 1 to 65535")
    return Address(scheme, host or DEFAULT_HOST, int(port), path)


def _reachable(host: str) -> str:
    """The address a client dials for a server told to listen on `host`: any-address means this machine."""
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return "127.0.0.1" if ipaddress.ip_address(host).version == 4 else "::1"
    except ValueError:
        pass
    return host


def server_address() -> Address:
    return parse_host(os.environ.get(HOST_ENV))


class ServerError(PebblingError):
    """The server answered with an error: its message, as it said it."""


class Client:
    """The Ollama API of one `pebbling serve`. Errors are PebblingError with the server's own message."""

    def __init__(self, address: Address | None = None, *, timeout: float | None = None):
        self.address = address or server_address()
        # Generation can take minutes on a big model: no read timeout, a short connect timeout.
        self._http = httpx.Client(base_url=self.address.url, timeout=httpx.Timeout(timeout, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def answers(self, seconds: float = PROBE_SECONDS) -> bool:
        """Whether a pebbling (or Ollama) server answers here within `seconds`."""
        try:
            response = self._http.get("/api/version", timeout=seconds)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def get(self, path: str) -> Any:
        return self._json(self._send("GET", path))

    def post(self, path: str, body: dict) -> Any:
        return self._json(self._send("POST", path, json=body))

    def send(self, method: str, path: str, body: dict) -> None:
        """A request whose answer is its status alone (copy, delete): an error is raised."""
        self._send(method, path, json=body)

    def has_blob(self, digest: str) -> bool:
        """Whether the server has the blob `digest` (sha256:<hex>)."""
        try:
            response = self._http.head(f"/api/blobs/{digest}")
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code not in (200, 404):
            raise ServerError(self._error_of(response))
        return response.status_code == 200

    def upload_blob(self, digest: str, chunks: Iterator[bytes]) -> None:
        """The blob `digest` uploaded from `chunks`, streamed (the server checks the bytes against it)."""
        self._send("POST", f"/api/blobs/{digest}", content=chunks, ok=(200, 201))

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """Each NDJSON line of a streamed answer, parsed; a line with an error is raised."""
        try:
            with self._http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise ServerError(self._error_of(response))
                for line in response.iter_lines():
                    if line.strip():
                        item = json.loads(line)
                        if "error" in item:
                            raise ServerError(str(item["error"]))
                        yield item
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None

    def _send(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kwargs) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code not in ok:
            raise ServerError(self._error_of(response))
        return response

    def _error_of(self, response: httpx.Response) -> str:
        """The server's error; for an unknown model (404), where it was asked and how to see what it has."""
        message = _error_of(response)
        if response.status_code == 404:
            message += f" by the server at {self.address.url} (pebbling list shows the models it serves)"
        return message

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"{self.address.url} answered something other than JSON: "
                              f"{response.text[:80]!r}") from None

    def _unreachable(self, exc: httpx.HTTPError) -> PebblingError:
        return PebblingError(f"could not reach pebbling serve at {self.address.url} ({type(exc).__name__}: "
                             f"{exc}); start it with `pebbling serve`, or set ${HOST_ENV} to where it listens")


def _error_of(response: httpx.Response) -> str:
    try:
        message = response.json().get("error")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else f"the server answered {response.status_code}: {response.text[:200]}"

"""The HTTP connection: uvicorn's h11 protocol with read timeouts and a cap on open connections.

uvicorn times out only an idle keep-alive connection, so a client that sends its headers (or its body)
a byte at a time holds a connection, and the memory behind it, for as long as it likes. Here:

- a request's headers must arrive within PEBBLING_HEADER_TIMEOUT seconds (default 10) of the
  connection opening or of its first byte after a previous response;
- its body within PEBBLING_BODY_TIMEOUT seconds (default 60) of its headers (a blob upload's, which
  may be gigabytes: within that many seconds of its previous bytes);
- past PEBBLING_MAX_CONNECTIONS open connections (default 4096), a new one is answered 503 and closed.

A connection past its timeout is closed without an answer, as Go's http.Server closes one past its
ReadTimeout. The limits are read once, when the module is imported; `limited()` makes a protocol with
others (tests, the benchmarks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from uvicorn.protocols.http.h11_impl import H11Protocol

from .bodies import STREAMED_UPLOADS

HEADER_TIMEOUT_ENV, BODY_TIMEOUT_ENV, MAX_CONNECTIONS_ENV = (
    "PEBBLING_HEADER_TIMEOUT", "PEBBLING_BODY_TIMEOUT", "PEBBLING_MAX_CONNECTIONS")
DEFAULT_HEADER_TIMEOUT, DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_CONNECTIONS = 10.0, 60.0, 4096

logger = logging.getLogger("pebbling.server")


def _env_number(name: str, default: float, kind=float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
        if value > 0:
            return value
    except ValueError:
        pass
    logger.warning("%s=%r is not a positive number; using %s", name, raw, default)
    return default


def _busy_response() -> bytes:
    body = json.dumps({"error": f"the server has too many connections open (its limit, {MAX_CONNECTIONS_ENV}, "
                                f"is reached); try again later"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class LimitedH11Protocol(H11Protocol):
    """H11Protocol with a deadline on reading each request's headers and body, and a connection cap."""

    header_timeout: float = _env_number(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT)
    body_timeout: float = _env_number(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT)
    max_connections: int = int(_env_number(MAX_CONNECTIONS_ENV, DEFAULT_MAX_CONNECTIONS, int))

    _read_timer: asyncio.TimerHandle | None = None
    _reading: str | None = None  # "headers", "body", or None: not waiting on the client

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning("refused a connection: %d open, the limit (%s) is %d", len(self.connections) - 1,
                           MAX_CONNECTIONS_ENV, self.max_connections)
            transport.write(_busy_response())
            transport.close()
            return
        self._expect("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading is None and (self.cycle is None or self.cycle.response_complete):
            self._expect("headers")  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.more_body:
                # A blob upload (gigabytes) may take long: its deadline counts from the last bytes it sent.
                if self._reading != "body" or cycle.scope["path"].startswith(STREAMED_UPLOADS):
                    self._expect("body")
            elif self._reading is not None:
                self._expect(None)  # the whole request is in: the app takes it from here

    def on_response_complete(self) -> None:
        self._expect(None)  # uvicorn's keep-alive timeout covers the wait for the next request
        super().on_response_complete()

    def _expect(self, what: str | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._reading = what
        if what is not None:
            timeout = self.header_timeout if what == "headers" else self.body_timeout
            self._read_timer = self.loop.call_later(timeout, self._timed_out, what, timeout)

    def _timed_out(self, what: str, timeout: float) -> None:
        self._read_timer = None
        if self._reading != what or self.transport.is_closing():
            return
        logger.info("closed a connection from %s: its request %s did not arrive within %g s",
                    "%s:%d" % self.client if self.client else "?", what, timeout)
        self.transport.close()


def limited(header_timeout: float | None = None, body_timeout: float | None = None,
            max_connections: int | None = None) -> type[LimitedH11Protocol]:
    """The protocol with other limits (None: the default's)."""
    base = LimitedH11Protocol
    return type("LimitedH11Protocol", (base,), {
        "header_timeout": base.header_timeout if header_timeout is None else header_timeout,
        "body_timeout": base.body_timeout if body_timeout is None else body_timeout,
        "max_connections": base.max_connections if max_connections is None else max_connections})

"""Serve an app on a free loopback port in a background thread, for tests and benchmarks."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from .connections import limited


@contextmanager
def serving(app, *, start_timeout: float = 20.0, header_timeout: float | None = None,
            body_timeout: float | None = None, max_connections: int | None = None) -> Iterator[str]:
    """Runs `app` with uvicorn on 127.0.0.1 and a free port, with `pebbling serve`'s connection limits
    (connections.py; each None: its default); yields its base URL."""
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so, and without
    # it every keep-alive request waits out a delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    protocol = limited(header_timeout, body_timeout, max_connections)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server on loopback did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

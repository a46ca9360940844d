"""A `pebbling serve` of this tree in a process of its own, on a free loopback port, for the benchmarks
that measure the server from outside."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def start_server(models: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """(the server process, its URL) once it answers; `env`: variables set for it beside the caller's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)  # this tree's pyplugin, whatever is installed
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "pyplugin.cli", "serve", "--port", str(port), "--models", models],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            requests.get(url, timeout=1)
            return server, url
        except requests.ConnectionError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the server did not start")
            time.sleep(0.1)

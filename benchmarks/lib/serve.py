"""The server seen from outside, for the benchmarks that measure it: a `pebbling serve` of this tree in a
process of its own on a free loopback port, the small model they serve, the prompts their clients send, and
what /proc says of the server process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from lib import ROOT

PROMPTS = ("Why is the sky blue?", "Tell me a story about a fox.", "List three prime numbers.", "Hello there",
           "What is a pebble?", "Explain batching in one line.", "Count from one to ten.", "Good morning!")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(models: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """(the server process, its URL) once it answers; `env`: variables set for it beside the caller's."""
    port = free_port()
    # this tree's pyplugin, whatever is installed
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
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


def write_small_llama(path: Path, n_layer: int, n_embd: int, n_ff: int, weight_type: str = "Q8_0") -> Path:
    """A random-weight llama of `n_layer` layers of `n_embd` (heads of 64, KV heads of 128), num_ctx 512."""
    from pyplugin.model.synth import write_gguf  # noqa: PLC0415 - imported where a file is written

    return write_gguf(path, arch="llama", n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64),
                      n_head_kv=max(1, n_embd // 128), n_ff=n_ff, n_ctx=512, weight_type=weight_type, n_merges=200)


def proc_figures(pid: int) -> dict[str, int]:
    """The process's resident memory (bytes), threads and open files, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"]),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used (/proc/PID/stat), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

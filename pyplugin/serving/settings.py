"""The environment variables that configure serving, in one place (Ollama's OLLAMA_* have the same jobs)."""

from __future__ import annotations

import ipaddress
import os

from ..errors import PebblingError

HOST_ENV = "PEBBLING_HOST"                # the address `pebbling serve` listens on (OLLAMA_HOST)
ORIGINS_ENV = "PEBBLING_ORIGINS"          # more browser origins allowed, comma-separated (OLLAMA_ORIGINS)
MAX_QUEUE_ENV = "PEBBLING_MAX_QUEUE"      # requests queued or running at once (OLLAMA_MAX_QUEUE)
MAX_CONTEXT_ENV = "PEBBLING_MAX_CONTEXT"  # the largest num_ctx served
NUM_PARALLEL_ENV = "PEBBLING_NUM_PARALLEL"  # requests to one model decoding together (OLLAMA_NUM_PARALLEL)
PARKED_KV_ENV = "PEBBLING_PARKED_KV_MIB"  # host memory per model for displaced conversations' KV caches
OLLAMA_NUM_PARALLEL_ENV = "OLLAMA_NUM_PARALLEL"
DEFAULT_MAX_QUEUE = 512
# Ollama's own default where memory allows: 4 sequences share each streamed layer's transfer, each
# holding a KV cache at num_ctx (a limit too small for 4 gets as many as fit).
DEFAULT_NUM_PARALLEL = 4
DEFAULT_PARKED_KV_MIB = 1024
DEFAULT_MAX_CONTEXT = 1 << 17


def env_limit(variable: str, default: int) -> int:
    """A positive integer from the environment, else `default`; a bad value is an error that says so."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 2**31:
        raise PebblingError(f"${variable} is {text[:40]!r}; it must be a whole number from 1 to {2**31 - 1}")
    return int(text)


def parallel_limit() -> int:
    """Requests to one model that decode together: $PEBBLING_NUM_PARALLEL, else $OLLAMA_NUM_PARALLEL (so a
    setting made for Ollama carries over), else DEFAULT_NUM_PARALLEL."""
    for variable in (NUM_PARALLEL_ENV, OLLAMA_NUM_PARALLEL_ENV):
        text = os.environ.get(variable, "").strip()
        if text and not (variable == OLLAMA_NUM_PARALLEL_ENV and text == "0"):  # Ollama's 0: its default
            return env_limit(variable, DEFAULT_NUM_PARALLEL)
    return DEFAULT_NUM_PARALLEL


def is_loopback(host: str) -> bool:
    """Whether a host name or address (IPv6 with or without brackets) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

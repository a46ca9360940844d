"""Which store backend to use: the one module that knows.

PEBBLING_BACKEND=cuda|host|stub picks one (and fails loudly if it cannot be used); otherwise the first
that works, in the order cuda, host, stub. "Works" means for cuda that its library loads and a CUDA
device takes a tiny store; for host that its library loads; the stub always works.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from .errors import PebbleError, PebblingError
from .store import TIER_DEVICE, Store

BACKENDS = ("cuda", "host", "stub")
logger = logging.getLogger("pebbling")

_probe_lock = threading.Lock()
_probes: dict[tuple[str, str | None], "BackendProbe"] = {}
_logged: set["BackendChoice"] = set()


@dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str
    library_path: str | None  # None for the stub


@dataclass(frozen=True)
class BackendProbe:
    name: str
    usable: bool
    reason: str               # why it can or cannot be used, one line
    library_path: str | None


def _probe_native(kind: str) -> BackendProbe:
    from ._native import NativeStore, load_library  # cffi only once a native backend is wanted

    try:
        _, path = load_library(kind)
    except (OSError, PebblingError) as exc:
        return BackendProbe(kind, False, str(exc), None)
    if kind == "host":
        return BackendProbe(kind, True, f"library {path} loaded", path)
    # The cuda library loads on machines without a GPU; only a store that moves bytes proves one.
    try:
        with NativeStore(1 << 16, 1, "none", kind="cuda") as store:
            store.save(0, 0, b"pebble", tier=TIER_DEVICE)
            store.restore(0, 0, bytearray(6))
    except PebbleError as exc:
        from .gpu import nvml_problem

        driver = nvml_problem()
        hint = f" (NVML: {driver})" if driver else ""
        return BackendProbe(kind, False, f"library {path} loaded but no CUDA device is usable: {exc}{hint}",
                            path)
    try:  # the model computes on the GPU through CuPy: without it the cuda store is of no use
        import cupy  # noqa: F401
    except ImportError:
        return BackendProbe(kind, False, f"library {path} works but CuPy is not installed "
                            f"(pip install 'pebbling[gpu]')", path)
    return BackendProbe(kind, True, f"library {path} loaded and CUDA device 0 took a test store", path)


def probe(name: str) -> BackendProbe:
    """Whether backend `name` can be used here, and why; cached per process (and PEBBLING_LIB)."""
    if name not in BACKENDS:
        raise PebblingError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    key = (name, os.environ.get("PEBBLING_LIB"))
    with _probe_lock:
        if key not in _probes:
            _probes[key] = (BackendProbe(name, True, "pure Python, always available", None)
                            if name == "stub" else _probe_native(name))
        return _probes[key]


def available_backends() -> list[BackendProbe]:
    return [probe(name) for name in BACKENDS]


def select_backend(requested: str | None = None) -> BackendChoice:
    """The backend to use: `requested`, else $PEBBLING_BACKEND, else the first of cuda, host, stub
    that works. A requested backend that is unknown or cannot be used raises PebblingError."""
    source = "requested by the caller"
    if not requested:
        requested, source = os.environ.get("PEBBLING_BACKEND", "").strip(), "requested by PEBBLING_BACKEND"
    if requested:
        name = requested.lower()
        if name not in BACKENDS:
            raise PebblingError(f"unknown backend {requested!r} ({source}); valid: {', '.join(BACKENDS)}")
        found = probe(name)
        if not found.usable:
            raise PebblingError(f"backend {name!r} ({source}) cannot be used: {found.reason}")
        choice = BackendChoice(name, f"{source}; {found.reason}", found.library_path)
    else:
        passed_over = []
        for name in BACKENDS:
            found = probe(name)
            if found.usable:
                break
            passed_over.append(f"{name}: {found.reason}")
        skipped = f" ({'; '.join(passed_over)})" if passed_over else ""
        choice = BackendChoice(name, f"first usable of {', '.join(BACKENDS)}{skipped}; {found.reason}",
                               found.library_path)
    with _probe_lock:
        if choice not in _logged:
            _logged.add(choice)
            logger.info("store backend %s: %s", choice.name, choice.reason)
    return choice


def open_store(device_limit: int, n_layers: int, strategy, *, device: int = 0,
               backend: str | None = None) -> Store:
    """A new store on the selected backend (see select_backend). `strategy`: a Strategy or its text."""
    choice = select_backend(backend)
    if choice.name == "stub":
        from ._stub import StubStore

        return StubStore(device_limit, n_layers, strategy, device=device)
    from ._native import NativeStore

    return NativeStore(device_limit, n_layers, strategy, device=device, kind=choice.name)

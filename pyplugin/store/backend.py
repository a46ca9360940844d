"""Store backends as objects, and which one to use: the one module that knows their names.

A `Backend` carries everything that differs between them, so that callers ask it rather than compare
names (tinygrad's devices are the model): its array module and compute type, how to open a store, its
kernels, and its device operations (streams, events, synchronising, the allocator's pool, measuring
device memory). The numpy backends (`host`, `stub`) make the device operations no-ops: a copy there is
done when its call returns, and memory is byte-accounted rather than measured.

PEBBLING_BACKEND=cuda|host|stub picks one (and fails loudly if it cannot be used); otherwise the first
that works, in the order cuda, host, stub. "Works" means for cuda that its library loads, a CUDA device
takes a tiny store and CuPy is installed; for host that its library loads; the stub always works.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import weakref
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import ClosedError, PebbleError, PebblingError
from ..xp import array_module, compute_dtype, free_cached
from . import gpu
from .abi import DEVICE_PAGE_BYTES, TIER_DEVICE, check_switches, paged
from .interface import Store
from .kernels import Kernels

BACKENDS = ("cuda", "host", "stub")
logger = logging.getLogger("pebbling")

_lock = threading.Lock()
_probes: dict[tuple[str, str | None], "BackendProbe"] = {}
_backends: dict[tuple[str, str | None], "Backend"] = {}
_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class BackendProbe:
    name: str
    usable: bool
    reason: str               # why it can or cannot be used, one short line (what a server logs at start)
    library_path: str | None
    detail: str = ""          # the whole story where the reason shortens it (`pebbling info` prints it)


class Backend:
    """A backend whose arrays are numpy's and whose device operations are no-ops (`host`, `stub`)."""

    arrays_on_device = False  # whether its arrays (xp) live in device memory
    copies_overlap = False    # whether restores run beside compute (on streams of their own)
    measures_memory = False   # whether device memory is measured (else byte-accounted)
    device_page_bytes = 0     # the device holds an allocation of half a page or more in whole pages (0: bytes)

    def __init__(self, name: str, library_path: str | None):
        self.name, self.library_path = name, library_path
        self._stores: weakref.WeakSet[Store] = weakref.WeakSet()  # every store this process opened here
        self._overhead, self._overhead_lock = 0, threading.Lock()

    def __repr__(self) -> str:
        return f"<Backend {self.name}>"

    @property
    def xp(self) -> ModuleType:
        return np

    @property
    def compute_dtype(self) -> np.dtype:
        return compute_dtype(self.xp)

    def device_footprint(self, nbytes: int) -> int:
        """What the store's device tier counts for an entry of `nbytes` (pebble.h, PEBBLE_DEVICE_PAGE_BYTES)."""
        return paged(nbytes, self.device_page_bytes)

    # -- the store and the kernels

    def open_store(self, device_limit: int, n_layers: int, strategy, *, device: int = 0) -> Store:
        from .native import NativeStore  # cffi only once a native backend is wanted

        store = NativeStore(device_limit, n_layers, strategy, device=device, kind=self.name)
        self._stores.add(store)
        return store

    def overhead_bytes(self) -> int | None:
        """This process's own fixed cost on the device (measured where memory is measured, else None): what
        NVML counts beyond CuPy's pool and every open store's device tier (the CUDA context, cuBLAS, loaded
        kernels). The most ever measured: they belong to the process, not to one model, and only grow as
        kernels load, so every model's plan counts the same, and one planned later never counts less."""
        used = self.used_memory() if self.measures_memory else None
        if used is None:
            return None
        tiers = 0
        for store in list(self._stores):
            try:
                tiers += store.stats().device_bytes
            except ClosedError:  # closed since: its memory is given back
                pass
        with self._overhead_lock:
            self._overhead = max(self._overhead, used.bytes - self.pool_bytes() - tiers)
            return self._overhead

    @cached_property
    def kernels(self) -> Kernels:
        """The kernels that compute on this backend's arrays."""
        from .native_kernels import NativeKernels

        return Kernels(NativeKernels(self.name), self.xp, self.current_stream)

    @property
    def host_kernels(self) -> Kernels:
        """Kernels that compute on numpy arrays (this backend's own, where its arrays are numpy's)."""
        return self.kernels

    # -- device operations

    def current_stream(self) -> Any:
        """The stream compute is enqueued on (None: work is done when its call returns)."""
        return None

    def copy_stream(self) -> Any:
        """A stream for copies that may run beside compute (None where copies do not overlap)."""
        return None

    def event(self) -> Any:
        return None

    def record(self, event: Any, stream: Any = None) -> None:
        """Marks `event` done when the work enqueued so far on `stream` (None: the compute stream) is."""

    def wait(self, event: Any, stream: Any = None) -> None:
        """Makes later work on `stream` (None: the compute stream) wait for `event`."""

    def synchronize(self) -> None:
        """Waits until the compute stream's work is done."""

    def free_pool(self) -> None:
        """Gives the array allocator's cached blocks back, so the next measurement is of live memory."""

    def pool_bytes(self) -> int:
        """Bytes the array allocator holds (0 where numpy allocates)."""
        return 0

    def used_memory(self) -> gpu.DeviceUse | None:
        """Device memory this process holds, measured; None where it is not measured."""
        return None

    def free_memory(self) -> int | None:
        """Free device memory, measured; None where there is no device to ask."""
        return None


class HostBackend(Backend):
    """The native library built for the host: its kernels run on a thread pool of its own, one thread per
    CPU, so the BLAS under numpy (the attention's small products) is held to one thread. OpenBLAS's
    threads spin after each product and took the cores from the pool's: a prefill ran 1.4x slower. A
    thread count set for the BLAS in the environment is left as it is."""

    @cached_property
    def kernels(self) -> Kernels:
        if not any(os.environ.get(v) for v in _BLAS_THREAD_VARIABLES):
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=1, user_api="blas")
        return super().kernels


_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class StubBackend(Backend):
    """The pure-Python store and numpy kernels."""

    def open_store(self, device_limit: int, n_layers: int, strategy, *, device: int = 0) -> Store:
        from .stub import StubStore

        return StubStore(device_limit, n_layers, strategy, device=device)

    @cached_property
    def kernels(self) -> Kernels:
        from .stub_kernels import StubKernels

        return StubKernels().kernels


class CudaBackend(Backend):
    """The cuda library's store, CuPy arrays, streams and events; memory measured by NVML."""

    arrays_on_device = True
    copies_overlap = True
    measures_memory = True
    device_page_bytes = DEVICE_PAGE_BYTES

    @cached_property
    def xp(self) -> ModuleType:
        return array_module("cupy")

    @property
    def host_kernels(self) -> Kernels:
        return backend_named("host" if probe("host").usable else "stub").kernels

    def current_stream(self) -> Any:
        return self.xp.cuda.get_current_stream()

    def copy_stream(self) -> Any:
        return self.xp.cuda.Stream(non_blocking=True)

    def event(self) -> Any:
        return self.xp.cuda.Event(disable_timing=True)

    def record(self, event: Any, stream: Any = None) -> None:
        event.record(stream or self.current_stream())

    def wait(self, event: Any, stream: Any = None) -> None:
        (stream or self.current_stream()).wait_event(event)

    def synchronize(self) -> None:
        self.current_stream().synchronize()

    def free_pool(self) -> None:
        free_cached(self.xp)

    def pool_bytes(self) -> int:
        return int(self.xp.get_default_memory_pool().total_bytes())

    def used_memory(self) -> gpu.DeviceUse | None:
        return gpu.used_device_memory()

    def free_memory(self) -> int | None:
        return gpu.free_device_memory()


_CLASSES = {"cuda": CudaBackend, "host": HostBackend, "stub": StubBackend}


# ---------------------------------------------------------------------------------------------------
# probing and selection


def _build_hint(kind: str) -> str:
    """How to get a library that is missing, as things stand on this machine."""
    if kind == "host":
        return "`make host` builds it (a C++ compiler), as `pip install .` does"
    if shutil.which("nvcc"):
        return "nvcc is on PATH: `make cuda` builds it"
    return "`make cuda` builds it where the CUDA toolkit (nvcc) is installed"


def _cuda_cause(message: str) -> str:
    """The CUDA runtime's own words in a failed test store's message, without the call and the source
    line ("CUDA driver version is insufficient for CUDA runtime version")."""
    found = re.search(r"failed: (.*?)(?: \(native/[^)]*\))?$", message)
    return found.group(1) if found else message


def _probe_native(kind: str) -> BackendProbe:
    from .native import NativeStore, library_candidates, load_library

    try:
        _, path = load_library(kind)
    except (OSError, PebblingError) as exc:
        candidates = library_candidates(kind)
        missing = [p for p in candidates if not p.is_file()]
        short = f"no such file: {missing[0].name}" if len(missing) == len(candidates) else str(exc).split("; ")[-1]
        return BackendProbe(kind, False, f"{short}; {_build_hint(kind)}", None, f"{exc}")
    if kind == "host":
        return BackendProbe(kind, True, f"library {path} loaded", path)
    # The cuda library loads on machines without a GPU; only a store that moves bytes proves one.
    try:
        with NativeStore(1 << 16, 1, "none", kind=kind) as store:
            store.save(0, 0, b"pebble", tier=TIER_DEVICE)
            store.restore(0, 0, bytearray(6))
    except PebbleError as exc:
        driver = gpu.nvml_problem()
        hint = f" (NVML: {driver})" if driver else ""
        what = "no NVIDIA driver" if driver and "NotFound" in driver else "no usable NVIDIA GPU"
        return BackendProbe(kind, False, f"{what} ({_cuda_cause(str(exc))})", path,
                            f"library {path} loaded but no CUDA device is usable: {exc}{hint}; the cuda backend "
                            "needs an NVIDIA GPU (host runs on the CPU)")
    try:  # the model computes on the GPU through CuPy: without it the cuda store is of no use
        import cupy  # noqa: F401
    except ImportError:
        return BackendProbe(kind, False, f"library {path} works but CuPy is not installed "
                            "(pip install cupy-cuda13x; from the repository: pip install '.[gpu]')", path)
    return BackendProbe(kind, True, f"library {path} loaded and CUDA device 0 took a test store", path)


def probe(name: str) -> BackendProbe:
    """Whether backend `name` can be used here, and why; cached per process (and PEBBLING_LIB)."""
    if name not in BACKENDS:
        raise PebblingError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    key = (name, os.environ.get("PEBBLING_LIB"))
    with _lock:
        if key not in _probes:
            _probes[key] = (BackendProbe(name, True, "pure Python, always available", None)
                            if name == "stub" else _probe_native(name))
        return _probes[key]


def available_backends() -> list[BackendProbe]:
    return [probe(name) for name in BACKENDS]


def backend_named(name: str) -> Backend:
    """The backend `name`, which must be usable here (else PebblingError saying why); one object per
    process (and PEBBLING_LIB)."""
    found = probe(name)
    if not found.usable:
        raise PebblingError(f"backend {name!r} cannot be used: {found.reason}")
    key = (name, os.environ.get("PEBBLING_LIB"))
    with _lock:
        if key not in _backends:
            _backends[key] = _CLASSES[name](name, found.library_path)
        return _backends[key]


@dataclass(frozen=True)
class BackendChoice:
    backend: Backend
    reason: str


def choose_backend(requested: str | Backend | None = None) -> BackendChoice:
    """The backend to use and why: `requested`, else $PEBBLING_BACKEND, else the first of cuda, host,
    stub that works. A requested backend that is unknown or cannot be used, or a PEBBLING_CUDA_* switch set
    to a value it does not take, raises PebblingError."""
    try:
        check_switches(os.environ)
    except ValueError as exc:
        raise PebblingError(str(exc)) from None
    if isinstance(requested, Backend):
        return BackendChoice(requested, "given by the caller")
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
        reason = f"{source}; {found.reason}"
    else:
        passed_over = []
        for name in BACKENDS:
            found = probe(name)
            if found.usable:
                break
            passed_over.append(f"{name}: {found.reason}")
        skipped = f" ({'; '.join(passed_over)})" if passed_over else ""
        reason = f"first usable of {', '.join(BACKENDS)}{skipped}; {found.reason}"
    with _lock:
        if (name, reason) not in _logged:
            _logged.add((name, reason))
            logger.info("store backend %s: %s", name, reason)
    return BackendChoice(backend_named(name), reason)


def select_backend(requested: str | Backend | None = None) -> Backend:
    """The backend `choose_backend` chooses."""
    return choose_backend(requested).backend


def open_store(device_limit: int, n_layers: int, strategy, *, device: int = 0,
               backend: str | Backend | None = None) -> Store:
    """A new store on the selected backend (see choose_backend). `strategy`: a Strategy or its text."""
    return select_backend(backend).open_store(device_limit, n_layers, strategy, device=device)

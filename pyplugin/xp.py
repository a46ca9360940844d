"""The one place numpy and CuPy meet.

Model code is written once against an array module ``xp`` and asks this module for it. CuPy is
imported only when an array of it is seen or it is asked for by name, so importing pyplugin never
needs a GPU and never pays CuPy's import time.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy as np

from .errors import PebblingError

NAMES = ("numpy", "cupy")

# cuBLAS's workspace, per handle, and CuPy makes a handle per thread that multiplies: by default 64 MiB on
# an H200, held while the thread lives (a server's model thread, a request thread), which a plan measured
# on another thread does not see. No workspace (cuBLAS's :KiB:count form) made a handle cost nothing
# there, two 4 MiB buffers 8 MiB; a prefill's product (512 x 4096 by 4096 x 14336, fp16) took 118.7 us,
# 124.2 and 108.7 by default (one process each, H200, 11-27). Read when a handle is made, so set before
# CuPy makes one; a value in the environment is kept.
CUBLAS_WORKSPACE = ":0:0"


def get_array_module(*arrays: Any) -> ModuleType:
    """cupy if any argument is a CuPy array, else numpy (like ``cupy.get_array_module``)."""
    for a in arrays:
        if type(a).__module__.partition(".")[0] == "cupy":
            import cupy
            return cupy
    return np


def array_module(name: str = "numpy") -> ModuleType:
    """'numpy' or 'cupy' -> the module, with an error a person can act on when CuPy cannot run."""
    if name == "numpy":
        return np
    if name != "cupy":
        raise PebblingError(f"unknown array module {name!r}; valid: {', '.join(NAMES)}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    try:
        import cupy
    except ImportError as exc:
        raise PebblingError("the cupy array module needs CuPy: pip install cupy-cuda13x, or the cupy-cudaXXx "
                            "wheel matching your CUDA driver (from the repository: pip install '.[gpu]'); "
                            f"{exc}") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise PebblingError("CuPy is installed but sees no GPU")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise PebblingError(f"CuPy is installed but CUDA is not usable: {exc}") from None
    return cupy


def cupy_usable() -> bool:
    """Whether ``array_module('cupy')`` would work here."""
    try:
        array_module("cupy")
    except PebblingError:
        return False
    return True


def compute_dtype(xp: ModuleType) -> np.dtype:
    """float32 on the host; float16 on the GPU, where memory and bandwidth are what run out."""
    return np.dtype(np.float32 if xp is np else np.float16)


def to_xp(array: Any, xp: ModuleType, dtype: Any = None) -> Any:
    """``array`` as an ``xp`` array of ``dtype`` (a host-to-device copy when xp is cupy)."""
    return xp.asarray(array, dtype=dtype)


def to_numpy(array: Any) -> np.ndarray:
    """A host numpy array (a device-to-host copy for CuPy arrays)."""
    return np.asarray(array) if get_array_module(array) is np else array.get()


def free_cached(xp: ModuleType) -> None:
    """Gives the memory of CuPy's pool's unused blocks back to the device (nothing to do for numpy)."""
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()

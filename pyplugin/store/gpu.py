"""What NVIDIA GPUs this machine has and how much memory is free on them, through NVML (pynvml).

On a machine without an NVIDIA driver every query answers "none" ([] or None) and `nvml_problem()`
says why in one line; nothing here raises for a missing driver.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

_lock = threading.Lock()
_state: dict[str, object] = {}  # "nvml": the initialised module, or "problem": why it is unavailable


class GpuInfo(NamedTuple):
    index: int
    name: str
    total_bytes: int
    free_bytes: int


def _nvml():
    """pynvml, initialised once per process; None (with the reason kept) when NVML is unusable."""
    with _lock:
        if not _state:
            try:
                import pynvml
                pynvml.nvmlInit()
                _state["nvml"] = pynvml
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
                _state["problem"] = _one_line(exc)
        return _state.get("nvml")


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


def nvml_problem() -> str | None:
    """Why NVML cannot be used (one line), or None when it can."""
    _nvml()
    return _state.get("problem")


def list_gpus() -> list[GpuInfo]:
    """Every GPU NVML sees, with total and free memory in bytes; [] without a driver."""
    nvml = _nvml()
    if nvml is None:
        return []
    gpus = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuInfo(index, name.decode() if isinstance(name, bytes) else name,
                                int(memory.total), int(memory.free)))
    except nvml.NVMLError:
        pass  # a GPU that stops answering mid-listing (fallen off the bus): report the ones that did
    return gpus


def free_device_memory(index: int = 0) -> int | None:
    """Free memory on GPU `index` in bytes, or None when NVML cannot say (no driver, no such GPU)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index)).free)
    except nvml.NVMLError:
        return None


class DeviceUse(NamedTuple):
    bytes: int
    this_process: bool  # NVML's per-process figure; False: the whole device, other processes too

    @property
    def how(self) -> str:
        return "NVML, this process" if self.this_process else "NVML, whole device"


def used_device_memory(index: int = 0) -> DeviceUse | None:
    """Device memory this process holds on GPU `index` as NVML counts it (CUDA context, allocator
    pools and the store together); None when NVML cannot say.

    NVML's per-process figure is used where it lists this process; otherwise the device's whole
    used memory, which also counts other processes, and says so."""
    import os

    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return DeviceUse(int(proc.usedGpuMemory), True)
        return DeviceUse(int(nvml.nvmlDeviceGetMemoryInfo(handle).used), False)
    except nvml.NVMLError:
        return None

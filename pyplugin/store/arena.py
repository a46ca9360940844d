"""Host memory for the weights the host library computes from in place: one anonymous mapping per model,
asked for in transparent huge pages (madvise MADV_HUGEPAGE, where the kernel has it).

A decode step on the CPU reads every weight once per token, so it runs at the speed of memory. Read
through the GGUF file's own mapping, those bytes sit in 4 KiB page-cache pages: a page-table walk every
4 KiB, and the hardware's prefetchers stop at each page's end. Copied once into 2 MiB pages, the same
step ran about 13% faster here (Qwen2.5-1.5B's shape, Q4_K_M-like, 2 threads, runs interleaved: 22.0-24.4
against 20.3-21.1 tokens/s). The file's pages are given back as each tensor is copied, so the process holds the weights
once. `PEBBLING_USE_MMAP=1` keeps computing from the file's mapping instead (as llama.cpp's default
`mmap` does, and Ollama's `use_mmap`): no copy at load, and pages the kernel may share and reclaim; so do
weights that would take more than 80% of the memory available (`fits`: the KV cache and the activations
come on top).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

ALIGN = 64  # each tensor starts on a cache line, as the kernels' loads want it


def use_mmap() -> bool:
    """Whether PEBBLING_USE_MMAP asks to compute from the file's mapping (1/true/yes/on)."""
    return os.environ.get("PEBBLING_USE_MMAP", "").strip().lower() in ("1", "true", "yes", "on")


def fits(nbytes: int, share: float = 0.8) -> bool:
    """Whether a copy of `nbytes` takes at most `share` of the memory available now (MemAvailable; where
    it cannot be read, the physical memory). A model near the machine's memory, or past it, stays in the
    file's mapping, which the kernel can page from the file: a copy could not be given back. A 17.4 GiB
    Qwen3-30B-A3B-shaped file with 22.5 GiB available is copied (its decode: 10.4 tok/s from the copy,
    8.4 from the file's pages, in two runs of benchmarks/speed.py cpu the same hour)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return False
    return nbytes <= share * available


class HostArena:
    """`nbytes` of anonymous host memory (zero-filled, huge pages asked for), handed out in order by
    `place`. Views of it keep it alive."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge_pages = True
            except OSError:  # a kernel without transparent huge pages: ordinary pages
                pass
        self._used = 0

    @staticmethod
    def size_of(arrays) -> int:
        """Bytes an arena needs to place each of `arrays` (their nbytes, each rounded up to ALIGN)."""
        return sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays)

    def place(self, data: np.ndarray) -> np.ndarray:
        """A copy of `data` in the arena: the same shape and dtype, C-contiguous."""
        n = data.nbytes
        if self._used + n > len(self._map):
            raise ValueError(f"host arena: {n} bytes do not fit in the {len(self._map) - self._used} left")
        view = np.frombuffer(self._map, np.uint8, n, self._used)
        view[...] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._used += -(-n // ALIGN) * ALIGN
        return view.view(data.dtype).reshape(data.shape)

"""Reading a GGUF file: its metadata, and its tensors one at a time, as bytes or dequantized.

The header is parsed here from a memory map (gguf_header.py): gguf's GGUFReader builds a numpy view
per field part, which for a 152k-token vocabulary takes seconds, where reading the same values with
struct and numpy takes a tenth of one. Tensor data is read through the same map so that, once a
tensor is dequantized or copied, its file pages can be dropped from this process (madvise) and host
memory while loading stays near the size of what is kept. Every failure becomes one ModelError that
names the file and the problem.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ..errors import ModelError
from ..ggml_types import SUPPORTED_NAMES, SUPPORTED_TYPES
from .gguf_header import parse_header

T = GGMLQuantizationType
GGUF_MAGIC = b"GGUF"


class TensorInfo:
    """Where a tensor lies in the file and what it holds; ``shape`` is numpy order (GGUF ne reversed)."""

    __slots__ = ("name", "qtype", "shape", "offset", "nbytes")

    def __init__(self, name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...], offset: int,
                 nbytes: int):
        self.name, self.qtype, self.shape, self.offset, self.nbytes = name, qtype, shape, offset, nbytes

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {self.qtype.name}, {self.shape})"


class GGUFFile:
    """An open GGUF file. Use as a context manager, or call ``close()``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        _check_magic(self.path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            header = parse_header(self._map)
        except Exception as exc:  # struct errors, bad UTF-8, counts past the end... on damaged files
            self.close()
            raise ModelError(f"{self.path}: damaged or truncated GGUF file "
                             f"({type(exc).__name__}: {exc})") from None
        self.metadata: dict[str, Any] = header.metadata
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, ne, offset in header.tensors:
            try:
                qtype = T(ggml_type)
            except ValueError:
                self.close()
                raise ModelError(f"{self.path}: tensor {name} has type id {ggml_type}, which is not a GGUF "
                                 "type") from None
            shape = tuple(reversed(ne))
            problem = _shape_problem(qtype, shape)
            if problem:
                self.close()
                raise ModelError(f"{self.path}: tensor {name} ({qtype.name}, shape {list(ne)} in GGUF order) "
                                 f"{problem}")
            self.tensors[name] = TensorInfo(name, qtype, shape, header.data_start + offset,
                                            _tensor_bytes(qtype, shape))
        self._check_sizes()
        self._check_alignment(header.data_start, header.alignment)

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # an array still views the map (an exception's frames); GC will unmap it
            pass

    def _check_sizes(self) -> None:
        size = self.path.stat().st_size
        for t in self.tensors.values():
            if t.offset + t.nbytes > size:
                raise ModelError(f"{self.path}: truncated: tensor {t.name} ends at byte "
                                 f"{t.offset + t.nbytes}, the file has {size} bytes")

    def _check_alignment(self, data_start: int, alignment: int) -> None:
        # llama.cpp refuses these too: read from where the file says, they would be some other bytes.
        for t in self.tensors.values():
            if (t.offset - data_start) % alignment:
                raise ModelError(f"{self.path}: tensor {t.name} starts at byte {t.offset - data_start} of the "
                                 f"data section, not a multiple of the file's alignment ({alignment})")

    def require(self, key: str) -> Any:
        """A metadata value that must be present."""
        if key not in self.metadata:
            raise ModelError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]

    def check_types(self) -> None:
        """Refuse the whole file up front, naming the first tensor whose type we cannot dequantize."""
        for t in self.tensors.values():
            if int(t.qtype) not in SUPPORTED_TYPES:
                supported = ", ".join(sorted(SUPPORTED_NAMES))
                raise ModelError(f"{self.path}: tensor {t.name} has type {t.qtype.name}, "
                                 f"which is not supported; supported types: {supported}")

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array of its numpy shape; its file pages are dropped after."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: missing tensor {name!r}")
        try:
            return dequantize_bytes(np.frombuffer(self._map, np.uint8, t.nbytes, t.offset), t.qtype, t.shape)
        finally:
            self._drop_pages(t.offset, t.nbytes)

    def raw(self, name: str) -> np.ndarray:
        """A 2-D tensor's bytes as the file stores them, uint8 [rows, row bytes] (a 3-D one's, such as merged
        experts, as its rows one after another): a read-only view of the
        file's memory map, not a copy, so loading reads nothing until the bytes are used (the map lives
        as long as a view of it does). drop_file_pages gives the pages back once they are copied."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: missing tensor {name!r}")
        if len(t.shape) < 2:
            raise ModelError(f"{self.path}: tensor {name} has shape {t.shape}; only matrices (and stacks of "
                             "them) are kept in their GGUF form")
        rows = int(np.prod(t.shape[:-1]))
        raw = np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)
        return raw.reshape(rows, t.nbytes // rows)

    def _drop_pages(self, offset: int, nbytes: int) -> None:
        # The data was copied out; without this its pages stay counted in our resident memory.
        if not hasattr(self._map, "madvise"):
            return
        start = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)


def file_map_of(array: np.ndarray) -> mmap.mmap | None:
    """The open memory map of a file that `array` views, or None: a copy, or a view of an anonymous map
    (store/arena.py's, whose pages MADV_DONTNEED would not give back but zero)."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else getattr(base, "obj", None)
    if base is None or base.closed:
        return None
    try:
        base.size()  # the size of the file it maps; an anonymous map has none
    except OSError:
        return None
    return base


def _file_map_range(array: np.ndarray) -> tuple[mmap.mmap, int, int] | None:
    """(the memory map `array` views, the first page's offset, the length to its end), or None where
    `array` is no view of an open GGUF file's map."""
    base = file_map_of(array)
    if base is None or not hasattr(base, "madvise") or array.nbytes == 0:
        return None
    start = array.__array_interface__["data"][0] - np.frombuffer(base, np.uint8, 1).__array_interface__["data"][0]
    first = start - start % mmap.PAGESIZE
    return base, first, start + array.nbytes - first


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+


def map_file_pages(array: np.ndarray) -> None:
    """Maps the pages of a view of a GGUF file's memory map into this process now, in one call, rather
    than one page fault at a time when a kernel first reads them (as llama.cpp maps its files with
    MAP_POPULATE): for weights the store computes from in place. Where the kernel cannot
    (MADV_POPULATE_READ is Linux 5.14+), the pages are read ahead instead."""
    found = _file_map_range(array)
    if found is None:
        return
    base, first, length = found
    try:
        base.madvise(_MADV_POPULATE_READ, first, length)
    except OSError:
        base.madvise(mmap.MADV_WILLNEED, first, length)


def drop_file_pages(array: np.ndarray) -> None:
    """Drops the pages of a view of a GGUF file's memory map (GGUFFile.raw) from this process's
    resident memory, once its bytes are copied elsewhere (into a store): they are read from the file
    again if the view is used later. Anything else (a copy, a CuPy array) is left as it is."""
    found = _file_map_range(array)
    if found is not None:
        base, first, length = found
        base.madvise(mmap.MADV_DONTNEED, first, length)


def _shape_problem(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> str | None:
    """What is wrong with a tensor of `shape` (numpy order) in blocks of `qtype`, or None: as llama.cpp's
    loader, every row (the innermost dimension) must be whole blocks; a dimension of 0 describes no tensor
    a model can use, and would divide by zero where rows are counted."""
    if any(d < 1 for d in shape):
        return "has a dimension of 0; every dimension must be at least 1"
    block = GGML_QUANT_SIZES[qtype][0]
    if shape and shape[-1] % block:
        return (f"has rows of {shape[-1]} elements, not a whole number of the type's {block}-element blocks; "
                f"the first dimension must be a multiple of {block}")
    return None


def _tensor_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """The bytes of a tensor of `shape` (numpy order) in blocks of `qtype`, as gguf counts them."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n * type_size // block


def dequantize_bytes(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes -> a float32 array of ``shape`` that owns its memory."""
    qtype = T(int(qtype))
    if qtype == T.F32:
        return raw.view(np.float32).reshape(shape).copy()
    if qtype == T.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
    return gguf_dequantize(rows, qtype)


def _check_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if head != GGUF_MAGIC:
        # The first bytes are not echoed: the file may be anything a link points at.
        what = "the file is empty" if not head else f"it does not start with {GGUF_MAGIC!r}"
        raise ModelError(f"{path}: not a GGUF file ({what})")

"""The header of a GGUF file (metadata and tensor table), parsed in one pass over a memory map.

gguf-py's GGUFReader builds several numpy views for every element of every array: a 262144-token
vocabulary (Gemma 3's) took it over 10 s and some 600 MB. Here a string array is a list of str
decoded straight from the map, a numeric array one numpy read, so the same header reads in well under a
second. Every read is bounds-checked against the file, so a damaged or crafted header fails with a
message (ValueError, which the caller words for the user) instead of reading past the end or sizing a
huge allocation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class RawTensor:
    name: str
    ggml_type: int
    ne: tuple[int, ...]      # GGUF order: innermost dimension first
    offset: int              # from the start of the data section


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[RawTensor]
    data_offset: int         # where the data section starts in the file
    alignment: int


class _Cursor:
    def __init__(self, buf: Any):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"the header runs past the end of the file at byte {self.pos} (wanted {n} more)")
        at, self.pos = self.pos, self.pos + n
        return at

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self.take(size))[0]

    def count(self, each: int = 1) -> int:
        n = self.scalar("<Q")
        if n * each > self.size - self.pos:  # every element takes at least `each` bytes
            raise ValueError(f"a count of {n} at byte {self.pos - 8} cannot fit in the file")
        return n

    def string(self) -> str:
        n = self.count()
        at = self.take(n)
        return bytes(self.buf[at:at + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item = self.scalar("<I")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                n = self.count(dtype.itemsize)
                values = np.frombuffer(self.buf, dtype, n, self.take(n * dtype.itemsize))
                return (values.astype(bool) if item == 7 else values).tolist()
            if item == _STRING:
                return [self.string() for _ in range(self.count(8))]
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(self.count(12))]
            raise ValueError(f"unknown array element type {item}")
        raise ValueError(f"unknown metadata value type {vtype}")


def read_header(buf: Any) -> Header:
    """Parse the header in `buf` (bytes, mmap or memoryview of the whole file)."""
    c = _Cursor(buf)
    at = c.take(4)
    if bytes(buf[at:at + 4]) != b"GGUF":
        raise ValueError("the file does not start with b'GGUF'")
    version = c.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.count(24), c.count(12)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        if key in metadata:
            raise ValueError(f"metadata key {key!r} appears twice")
        metadata[key] = c.value(c.scalar("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} are possible)")
        ne = tuple(c.scalar("<Q") for _ in range(n_dims))
        tensors.append(RawTensor(name, c.scalar("<I"), ne, c.scalar("<Q")))
    alignment = metadata.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment is {alignment!r}; it must be a power of two")
    data_offset = -(-c.pos // alignment) * alignment
    return Header(version, metadata, tensors, data_offset, alignment)

"""A GGUF file's header (metadata and tensor table), parsed from a buffer with struct and numpy.

The format (gguf-py's and llama.cpp's, versions 2 and 3, little-endian): magic, version, tensor and
key counts, then each key with a typed value (arrays of one type, strings as a 64-bit length and
UTF-8), then each tensor's name, dimensions, type and offset, then the data at the next multiple of
general.alignment (32 unless given). Values come out as gguf's ReaderField.contents() gives them:
Python scalars, str, and lists.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF value types: struct format (scalars), numpy dtype (arrays of them)
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass
class Header:
    metadata: dict[str, Any]
    tensors: list[tuple[str, int, tuple[int, ...], int]]  # name, GGUF type id, ne (GGUF order), data offset
    data_start: int
    alignment: int


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = memoryview(buf), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{n} bytes at byte {self.pos} run past the end ({len(self.buf)} bytes)")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def string(self) -> str:
        return str(self.take(self.u64()), "utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype == _STRING:
                return self.strings(count)
            if etype not in _SCALARS:
                raise ValueError(f"array of value type {etype}")
            dtype = np.dtype(_SCALARS[etype][1])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"value type {vtype}")
        fmt = _SCALARS[vtype][0]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def strings(self, count: int) -> list[str]:
        # The hot loop of a large vocabulary: local names, one slice and one decode per string.
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"string {len(out)} of {count} runs past the end")
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > end:
                raise ValueError(f"string {len(out)} of {count} runs past the end")
            append(str(buf[pos:pos + n], "utf-8"))
            pos += n
        self.pos = pos
        return out


def parse_header(buf) -> Header:
    """The header of the GGUF file in `buf` (bytes, mmap...). Raises ValueError (or struct.error,
    UnicodeDecodeError) on anything that is not a whole little-endian GGUF v2/v3 header."""
    c = _Cursor(buf)
    if bytes(c.take(4)) != b"GGUF":
        raise ValueError("no GGUF magic")
    version = c.u32()
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian, or not 2 or 3)")
    n_tensors, n_kv = c.u64(), c.u64()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.u32())
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.u32()
        if not 1 <= n_dims <= 4:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        ne = tuple(c.u64() for _ in range(n_dims))
        ggml_type = c.u32()
        tensors.append((name, ggml_type, ne, c.u64()))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-c.pos // alignment) * alignment
    return Header(metadata, tensors, data_start, alignment)

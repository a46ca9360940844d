"""KV cache types: what a K or V row is stored as, and the one encoder and decoder of their blocks.

A leaf that every layer may import. `f16` is the default everywhere (Ollama's and llama.cpp's); `q8_0`
and `q4_0` are llama.cpp's block formats (32 elements a block, an fp16 scale first), which halve and
nearly quarter the memory; `f32` is kept for comparisons. A cache of a dense type is an array
[rows, n_head_kv, head_dim] of that dtype; a cache of a block type is uint8 [rows, n_head_kv,
head_dim / 32 * block bytes], so a head's blocks are its own (head_dim must be a multiple of 32, as
llama.cpp asks of quantized caches). The native library encodes and decodes the same bytes
(native/pebble_kv.h); tests hold the two together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from .errors import OptionsError
from .ggml_types import block
from .xp import get_array_module

Array = Any


@dataclass(frozen=True)
class KVType:
    name: str
    ggml_type: int        # GGUF type id, as the native library takes it
    block: int            # elements a block (1: a dense type)
    block_bytes: int      # bytes a block

    @property
    def quantized(self) -> bool:
        return self.block > 1

    @property
    def dtype(self) -> np.dtype:
        """The cache arrays' dtype: the float itself, or bytes of blocks."""
        return np.dtype({"f32": np.float32, "f16": np.float16}.get(self.name, np.uint8))

    def head_width(self, head_dim: int) -> int:
        """The last dimension of a cache: head_dim elements, or their blocks' bytes."""
        return head_dim // self.block * self.block_bytes if self.quantized else head_dim

    def row_bytes(self, elements: int) -> int:
        """Bytes of `elements` values (a whole number of blocks)."""
        return elements // self.block * self.block_bytes

    def shape(self, rows: int, n_head_kv: int, head_dim: int) -> tuple[int, int, int]:
        return (rows, n_head_kv, self.head_width(head_dim))

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.block:
            raise OptionsError(f"KV cache type {self.name!r} needs a head_dim that is a multiple of {self.block}; "
                               f"this model's is {head_dim}: use f16")


def _of(name: str) -> KVType:
    """The KV type of GGUF type `name` (its id and block layout as gguf gives them)."""
    ggml = int(GGMLQuantizationType[name.upper()])
    return KVType(name, ggml, *block(ggml))


KV_TYPES: dict[str, KVType] = {t.name: t for t in map(_of, ("f16", "q8_0", "q4_0", "f32"))}
KV_BY_GGML: dict[int, KVType] = {t.ggml_type: t for t in KV_TYPES.values()}
DEFAULT_KV_TYPE = "f16"
KV_ENV = ("PEBBLING_KV_CACHE_TYPE", "OLLAMA_KV_CACHE_TYPE")


def kv_type(name: Any, what: str = "option 'pebbling_kv_type'") -> KVType:
    """The KV type called `name`, or an OptionsError listing the accepted names."""
    if isinstance(name, str) and name.lower() in KV_TYPES:
        return KV_TYPES[name.lower()]
    raise OptionsError(f"{what}: got {str(name)[:40]!r}; accepted: {', '.join(KV_TYPES)}")


def default_kv_type(head_dim: int | None = None) -> str:
    """The server's KV type: PEBBLING_KV_CACHE_TYPE, else OLLAMA_KV_CACHE_TYPE, else f16; for a model whose
    heads are `head_dim` wide, f16 where that type's blocks do not divide them, as Ollama falls back
    (kv_fallback says why). An unknown name is an OptionsError listing the accepted ones: a server refuses
    it when it starts."""
    for env in KV_ENV:
        value = os.environ.get(env, "").strip()
        if value:
            name = kv_type(value, f"environment variable {env}").name
            return DEFAULT_KV_TYPE if head_dim is not None and head_dim % KV_TYPES[name].block else name
    return DEFAULT_KV_TYPE


def kv_fallback(head_dim: int) -> str:
    """Why a model whose heads are `head_dim` wide holds its KV cache in f16 rather than in the server's
    type (default_kv_type), or "" where it holds the server's."""
    name = default_kv_type()
    if default_kv_type(head_dim) == name:
        return ""
    env = next(e for e in KV_ENV if os.environ.get(e, "").strip())
    return (f"{env}={name} needs a head_dim that is a multiple of {KV_TYPES[name].block}; this model's is "
            f"{head_dim}: its KV cache is {DEFAULT_KV_TYPE}, as Ollama falls back")


def cache_kv_type(cache: Array, head_dim: int) -> KVType:
    """The KV type of a cache array (its dtype, or for bytes its head's width)."""
    if cache.dtype == np.float16:
        return KV_TYPES["f16"]
    if cache.dtype == np.float32:
        return KV_TYPES["f32"]
    for t in KV_TYPES.values():
        if t.quantized and cache.dtype == np.uint8 and cache.shape[-1] == t.head_width(head_dim):
            return t
    raise ValueError(f"a KV cache of {cache.dtype} {tuple(cache.shape)} is of no KV type for head_dim {head_dim}")


# ---------------------------------------------------------------------------------------------------
# blocks, as llama.cpp's reference quantizers write them (round half away from zero, as roundf)


def _round(x: Array, xp) -> Array:
    return xp.sign(x) * xp.floor(xp.abs(x) + np.float32(0.5))


def encode(rows: Array, t: KVType) -> Array:
    """float rows [..., n_head_kv, head_dim] as cache rows of type t."""
    xp = get_array_module(rows)
    if not t.quantized:
        return rows.astype(t.dtype, copy=False)
    lead = rows.shape[:-1]
    x = rows.astype(np.float32, copy=False).reshape(*lead, -1, 32)                  # [..., blocks, 32]
    if t.name == "q8_0":
        d = xp.abs(x).max(axis=-1) / np.float32(127)
        inv = xp.where(d > 0, np.float32(1) / xp.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
        q = _round(x * inv[..., None], xp).astype(np.int8).view(np.uint8)
    else:  # q4_0: the scale is the element of largest magnitude over -8, so that it maps to -8 exactly
        at = xp.abs(x).argmax(axis=-1)[..., None]
        d = xp.take_along_axis(x, at, axis=-1)[..., 0] / np.float32(-8)
        inv = xp.where(d != 0, np.float32(1) / xp.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
        q = xp.minimum(np.float32(15), xp.trunc(x * inv[..., None] + np.float32(8.5))).astype(np.uint8)
        q = q[..., :16] | (q[..., 16:] << 4)
    scale = d.astype(np.float16).view(np.uint8).reshape(*d.shape, 2)
    return xp.concatenate([scale, q], axis=-1).reshape(*lead, -1)


def decode(cache: Array, t: KVType, dtype=np.float32) -> Array:
    """Cache rows of type t [..., n_head_kv, width] as floats [..., n_head_kv, head_dim]."""
    if not t.quantized:
        return cache.astype(dtype, copy=False)
    xp = get_array_module(cache)
    lead = cache.shape[:-1]
    blocks = cache.shape[-1] // t.block_bytes  # spelled out, not -1: a cache of no rows still has a shape
    b = cache.reshape(*lead, blocks, t.block_bytes)
    d = xp.ascontiguousarray(b[..., :2]).view(np.float16).astype(np.float32)         # [..., blocks, 1]
    if t.name == "q8_0":
        q = b[..., 2:].view(np.int8).astype(np.float32)
    else:
        qs = b[..., 2:]
        q = xp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - np.float32(8)
    return (q * d).reshape(*lead, blocks * t.block).astype(dtype, copy=False)

"""How a model's layers are laid out in the store: the tensor id of each weight and of the KV cache,
the alignment of tensors inside a working slot, and views of a tensor over its stored bytes."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..ggml_types import DENSE_TYPES
from ..model import LayerWeights, QuantWeight
from ..store import TensorDesc

Array = Any

WEIGHT_IDS = {f.name: i for i, f in enumerate(fields(LayerWeights))}  # tensor id of each weight
K_ID, V_ID = len(WEIGHT_IDS), len(WEIGHT_IDS) + 1                         # ... of the KV cache


def kv_ids(seq: int) -> tuple[int, int]:
    """Tensor ids of the K and V entries of sequence `seq` of a batch (0: K_ID, V_ID). Each sequence's
    cache is pebbles of its own in every layer, resident or streamed with the layer like its weights."""
    return K_ID + 2 * seq, V_ID + 2 * seq


@dataclass(frozen=True)
class StoredTensor:
    """Where a layer's tensor is in the store, and how to view its bytes."""

    tensor_id: int
    name: str
    shape: tuple[int, ...]              # numpy order
    nbytes: int
    qtype: int | None = None            # GGUF type of a matrix kept in its file form; None: dense

    def view(self, raw: Array, dtype: np.dtype, kernels) -> Array | QuantWeight:
        """The tensor over `raw`, a flat uint8 array of exactly its bytes."""
        if self.qtype is None:
            return raw.view(dtype).reshape(self.shape)
        return QuantWeight(self.qtype, self.shape, raw.reshape(self.shape[0], -1), kernels)


def bytes_of(tensor: Array | QuantWeight) -> Array:
    """What the store copies for a tensor: a QuantWeight's bytes, an array itself."""
    return tensor.data if isinstance(tensor, QuantWeight) else tensor


def tensor_desc(kind: np.dtype | int, shape: tuple[int, ...]):
    """The store's desc of a tensor of numpy `shape`: `kind` a numpy dtype or a GGUF type id."""
    ggml_type = kind if isinstance(kind, int) else DENSE_TYPES[np.dtype(kind)]
    return TensorDesc(ggml_type, tuple(reversed(shape)))


def ring_rows(pos: int, n: int, rows: int) -> list[tuple[int, int]]:
    """The row ranges [start, stop) that positions pos..pos+n occupy in a cache of `rows` rows, position p
    in row p % rows (a full cache's rows are its positions; a sliding layer's ring keeps the last ones)."""
    first = max(pos, pos + n - rows)  # older positions of the chunk were overwritten within it
    start, stop = first % rows, (pos + n - 1) % rows + 1
    return [(start, stop)] if start < stop else [(start, rows), (0, stop)]


def process_memory() -> dict[str, int | None]:
    """This process's resident memory now and at its peak (Linux's VmRSS and VmHWM), measured; None
    where /proc does not say."""
    out: dict[str, int | None] = {"process_rss_bytes": None, "process_peak_rss_bytes": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key = "process_rss_bytes" if line.startswith("VmRSS") else "process_peak_rss_bytes"
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out

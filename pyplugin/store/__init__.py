"""The pebble store: entries of typed bytes across a bounded device tier and a host tier, behind one
interface with three backends (the cuda and host builds of the native library, and the pure-Python
stub), and the kernels that compute from quantized entries.

Modules, bottom up: `abi` (the C ABI's facts, a leaf), `strategy`, `interface` (the Store contract),
`step_model` (the decode step's structs and its making), `kernels`, `native` (cffi over native/pebble.h), `stub`,
`stub_kernels` and `stub_decoder` (the reference semantics), `gpu` (NVML), and `backend` (backends as objects, and
which one to use).
"""

from .abi import TIER_AUTO, TIER_DEVICE, TIER_HOST
from .backend import (BACKENDS, Backend, available_backends, backend_named, choose_backend, open_store, probe,
                      select_backend)
from .interface import EntryInfo, Store, StoreStats, TensorDesc
from .kernels import Decoder, Kernels, LayerShape
from .strategy import VALID_STRATEGIES, Strategy

__all__ = [
    "BACKENDS", "Backend", "EntryInfo", "Kernels", "LayerShape", "Store", "StoreStats", "Strategy",
    "TIER_AUTO", "TIER_DEVICE", "TIER_HOST", "TensorDesc", "VALID_STRATEGIES", "available_backends",
    "Decoder", "backend_named", "choose_backend", "open_store", "probe", "select_backend",
]

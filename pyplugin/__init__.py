"""pebbling: run GGUF models in any GPU memory budget by streaming layer state between device memory
and pinned host memory.

The public surface: the store (``open_store`` and its interface), strategies, and the errors.
Model loading and generation live in ``pyplugin.model`` and ``pyplugin.loop``.
"""

from .backend import open_store, select_backend
from .errors import ModelError, OptionsError, PebbleError, PebblingError
from .store import TIER_AUTO, TIER_DEVICE, TIER_HOST, EntryInfo, Stats, Store, TensorDesc
from .strategy import Strategy

__all__ = [
    "open_store", "select_backend", "Store", "Stats", "EntryInfo", "TensorDesc",
    "TIER_AUTO", "TIER_DEVICE", "TIER_HOST", "Strategy",
    "PebblingError", "PebbleError", "ModelError", "OptionsError",
]

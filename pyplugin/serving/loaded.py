"""A model an Engine has loaded, and what /api/ps shows of it."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model import Model
from ..runtime import Options, PebbledModel
from .catalogue import RunningModel, with_tag
from .jobs import FOREVER


@dataclass
class Loaded:
    key: Path                         # the resolved file: two names for one file share one model
    name: str                         # the name it was first asked for by
    weights: str                      # the form its weights are held in (pebbling_weights)
    model: Model | None = None
    pebbled: PebbledModel | None = None  # the model's layers in a pebble store
    expires_at: float = FOREVER       # time.monotonic() deadline once idle
    active: int = 0                   # requests queued or running
    size_vram: int = 0                # device memory measured at its last request (0: not measured)
    digest: str = ""                  # its ID and details as listed when it was loaded: /api/ps shows the
    details: dict[str, Any] = field(default_factory=dict)  # version loaded, even once its file is gone
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    jobs: queue.Queue = field(default_factory=queue.Queue)
    worker: threading.Thread | None = None

    def running(self, max_context: int) -> RunningModel | None:
        """What /api/ps shows of it (None once unloaded): Ollama's fields, with context_length the num_ctx
        its KV entries hold (before a request has run, the one a request naming none gets), and where its
        weights are: the bytes its plan keeps in device memory and in host memory (Plan.weight_placement,
        an estimate from the resident layers, never measured; all host memory where arrays are not on a
        device)."""
        model, pebbled = self.model, self.pebbled
        if model is None or pebbled is None:
            return None
        now_mono, now = time.monotonic(), time.time()
        expires = FOREVER if self.expires_at == FOREVER else now + max(0.0, self.expires_at - now_mono)
        if self.active:  # in use: it will be kept at least until its keep_alive after this request
            expires = max(expires, now)
        plan = pebbled.plan_in_use
        context = plan.memory.n_ctx if plan is not None else \
            Options.from_dict({}, n_ctx_train=model.config.n_ctx_train, max_ctx=max_context).num_ctx
        device, host = plan.weight_placement() if plan is not None else (0, model.host_bytes)
        if not pebbled.backend.arrays_on_device:
            device, host = 0, device + host
        placement = {"backend": pebbled.backend.name, "n_layers": model.config.n_layer,
                     "resident_layers": len(plan.resident) if plan is not None else 0,
                     "device_weight_bytes": device, "host_weight_bytes": host,
                     "placement_how": "estimated from the plan's resident layers"}
        return RunningModel(with_tag(self.name), self.key, model.host_bytes, self.size_vram, expires,
                            {**self.details, "pebbling_weights": self.weights}, self.digest, self.active, context,
                            placement)

"""Measurements the commands share: the store's restore bandwidth and per-call cost, the compute time
of one layer at decode, and the prediction of time per token built from those. Every figure here is
measured in this process or labelled a prediction; none is assumed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..model import layer_forward
from .pebbled import PebbledModel
from .plan import Plan

REPEATS = 5


def median_seconds(step, sync, repeats: int) -> float:
    step()  # warm-up: first touch of the pages, CuPy's kernel compilation
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class Transfer:
    bytes_per_s: float   # restore bandwidth for one slot-sized entry
    call_seconds: float  # the cost of one more store call, whatever its size
    entry_bytes: int
    repeats: int
    path: str            # what was copied to what, in words


def measure_restores(pebbled: PebbledModel, nbytes: int, repeats: int = REPEATS,
                     calls: int = 50) -> Transfer:
    """Restores through a store of the model's own backend (a store of its own, so the model's store
    and stats stay as they were), from the host tier into a device buffer:
    - bandwidth: the median rate of one `nbytes` entry (a working slot's size). On the GPU it is the
      pinned host -> device copy a streamed layer takes; on host and stub both sides are host memory
      and the figure is a memcpy rate, labelled so.
    - per call: `calls` restores of a 256-byte entry issued back to back, then one wait. A streamed
      layer takes a dozen calls per token, and on a small model their fixed cost (Python, cffi, the
      copy's launch) outweighs the bytes."""
    nbytes = max(int(nbytes), 1)
    xp, backend = pebbled.xp, pebbled.backend
    with backend.open_store(0, 2, "minimal") as store:
        store.save(0, 0, np.ones(nbytes, np.uint8), tier="host")
        store.save(1, 0, np.ones(256, np.uint8), tier="host")
        out, small = xp.empty(nbytes, np.uint8), xp.empty(256, np.uint8)
        stream = backend.copy_stream()
        if stream is not None:
            sync, path = stream.synchronize, "pinned host tier -> GPU buffer"
        else:
            sync, path = store.synchronize, "host tier -> host buffer (no GPU: a memcpy rate, not PCIe)"
        seconds = median_seconds(lambda: store.restore(0, 0, out, stream=stream), sync, repeats)

        def issue() -> None:
            for _ in range(calls):
                store.restore(1, 0, small, stream=stream)

        per_call = median_seconds(issue, sync, repeats) / calls
    return Transfer(nbytes / seconds, per_call, nbytes, repeats, path)


def store_calls_per_token(pebbled: PebbledModel, plan: Plan) -> int:
    """Store calls one decode step makes: per streamed layer, a restore per weight tensor, then its
    K and V rows read before it computes and its new row of each written after; none where the backend
    computes streamed layers from the host tier in place (its arrays are host memory)."""
    if not pebbled.backend.arrays_on_device:
        return 0
    return sum(len(pebbled.layouts[i]) + 4 for i in plan.streamed)


def layer_decode_seconds(pebbled: PebbledModel, n_ctx: int, context_pos: int,
                         repeats: int = REPEATS) -> float:
    """Median time of one decode step's `layer_forward` through layer 0, held on the device in the
    compute type as a resident layer is, with `context_pos` tokens already in its KV cache."""
    xp, dtype, cfg = pebbled.xp, pebbled.dtype, pebbled.model.config
    weights = pebbled.layer_weights(0)
    k, v = (xp.zeros(pebbled.kv_shape(n_ctx, 0), pebbled.kv.dtype) for _ in range(2))
    pos = min(context_pos, n_ctx - 1)  # the step writes row pos: it must lie inside the cache
    x = xp.asarray(np.random.default_rng(0).standard_normal((1, cfg.n_embd)), dtype=dtype)  # [1, n_embd]
    layer = cfg.for_layer(0)
    per_layer = xp.zeros((1, cfg.n_embd_per_layer), dtype) if cfg.n_embd_per_layer else None  # Gemma 4's input
    return median_seconds(lambda: layer_forward(layer, x, weights, k, v, pos, per_layer=per_layer),
                          pebbled.backend.synchronize, repeats)


@dataclass(frozen=True)
class Prediction:
    seconds_per_token: float
    slowdown: float  # against every layer resident


def predict(plan: Plan, restored_bytes: int, transfer: Transfer, calls: int, t_layer: float,
            overlapped: bool) -> Prediction:
    """Time per decoded token through the layer stack (embedding, output and sampling left out), for
    `calls` store calls restoring `restored_bytes` (PebbledModel.restored_bytes_per_token).

    The calls' fixed cost is paid by the thread that also launches the compute, so it adds to the
    compute side. With `overlapped` copies (the GPU: restores run on a copy stream while the layer
    before computes) a step is bound by that or by the bytes in flight, whichever is longer, plus one
    layer that cannot hide behind the other: max(L t + calls c, S/B + t). Without (host and stub copy
    on the calling thread) everything adds up: L t + calls c + S/B.
    """
    compute = plan.memory.n_layers * t_layer
    issue = calls * transfer.call_seconds
    transfer_s = restored_bytes / transfer.bytes_per_s
    if overlapped and transfer_s:
        seconds = max(compute + issue, transfer_s + t_layer)
    else:
        seconds = compute + issue + transfer_s
    return Prediction(seconds, seconds / compute)

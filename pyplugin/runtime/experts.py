"""Experts as pebbles: each expert of each layer of a mixture-of-experts model (its gate, up and down rows) an
entry of the store, and the decode step's cache of them per layer (pebble_step_layer.experts_stored).

A request asks for it with ``pebbling_expert_cache`` (experts of each layer kept on the device; 0 streams
every routed expert). The entries are made the first time a plan asks, from the layers' merged tensors in
the store; the decode step then restores an expert its tokens chose where the cache lacks it, once per
step for the whole batch, and the report counts the hits, misses and bytes. The dense part of each layer
(attention, norms, router, shared expert) keeps the strategy's rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import OptionsError
from ..store.kernels import EXPERT_MATRICES
from ..xp import to_numpy

EXPERT_ID = 1 << 16  # the entry of expert j of a layer: EXPERT_ID + j (past every weight and KV id)


def parse_expert_cache(value: Any) -> int | None:
    """pebbling_expert_cache: None (experts part of their layers), or experts per layer kept on the device."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 12:
        raise OptionsError(f"option 'pebbling_expert_cache': got {str(value)[:40]!r}; accepted: an integer from 0 "
                           "(every routed expert restored at each use) to 4096, experts of each layer kept on the device")
    return value


def expert_layers(pebbled: Any) -> list[int]:
    """The layers of `pebbled` whose FFN is a mixture of experts."""
    return [i for i, layout in enumerate(pebbled.layouts) if {t.name for t in layout} >= set(EXPERT_MATRICES)]


def save_expert_entries(pebbled: Any) -> int:
    """Saves each expert of each layer of experts as an entry of a store of their own (once per model:
    `pebbled.expert_store`, whose host tier keeps them whatever the layers' residency), from the merged
    tensors the layers' store holds; returns the bytes of one expert (0 for a model without experts)."""
    cached = getattr(pebbled, "_expert_bytes", None)
    if cached is not None:
        return cached
    n_expert, nbytes = pebbled.model.config.n_expert, 0
    store = pebbled.expert_store = pebbled.backend.open_store(0, pebbled.model.config.n_layer, "minimal")
    for i in expert_layers(pebbled):
        tensors = {t.name: t for t in pebbled.layouts[i]}
        parts = []
        for name in EXPERT_MATRICES:
            t = tensors[name]
            raw = pebbled.xp.empty(t.nbytes, np.uint8)
            pebbled.store.restore(i, t.tensor_id, raw)
            parts.append(to_numpy(raw).reshape(n_expert, -1))             # expert j's rows: row j
        for j in range(n_expert):
            data = np.concatenate([p[j] for p in parts])
            store.save(i, EXPERT_ID + j, data, tier="host")
            nbytes = data.nbytes
    pebbled._expert_bytes = nbytes
    return nbytes


def decoder_experts(layers: Any) -> dict[int, tuple[int, int]] | None:
    """For a StoreLayers whose request asked for an expert cache: {layer: (EXPERT_ID, experts cached)} for
    the decoder (Kernels.decoder's `experts`), the entries made first; else None."""
    cache = layers.pebbling.expert_cache
    if cache is None or not layers.pebbled.model.config.n_expert:
        return None
    save_expert_entries(layers.pebbled)
    return {i: (EXPERT_ID, min(cache, layers.pebbled.model.config.n_expert)) for i in expert_layers(layers.pebbled)}


def charge(costs: dict, seqs, before: dict, after: dict) -> None:
    """Divides a step's expert hits, misses and bytes restored equally among its sequences' costs."""
    share = 1 / len(seqs)
    for seq in seqs:
        cost = costs[seq]
        cost.expert_hits += (after["expert_hits"] - before["expert_hits"]) * share
        cost.expert_misses += (after["expert_misses"] - before["expert_misses"]) * share
        cost.expert_bytes += (after["expert_bytes_restored"] - before["expert_bytes_restored"]) * share
        cost.expert_steps += 1


def report(layers: Any, cost: Any) -> dict[str, Any] | None:
    """The report's "experts" object for a model of experts: the cache per layer (None: experts part of
    their layers), hits, misses, the hit rate and the expert bytes restored per decoded token."""
    cfg = layers.pebbled.model.config
    if not cfg.n_expert:
        return None
    ran, cache = cost.expert_hits + cost.expert_misses, layers.pebbling.expert_cache
    one = getattr(layers.pebbled, "_expert_bytes", None)
    return {"n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used, "cache_per_layer": cache,
            "expert_bytes": one,
            # the decode step's cache (device memory on the GPU), beside the plan's estimate: not in it yet
            "cache_bytes": None if cache is None or one is None else
            len(expert_layers(layers.pebbled)) * max(1, min(cache, cfg.n_expert)) * one,
            "hits": round(cost.expert_hits), "misses": round(cost.expert_misses),
            "hit_rate": round(cost.expert_hits / ran, 4) if ran else None,
            "bytes_restored_per_token": round(cost.expert_bytes / cost.expert_steps) if cost.expert_steps else None}


def estimate(pebbled: Any) -> dict[str, Any] | None:
    """What experts as pebbles would hold and move, for `pebbling estimate` (None without experts): the
    bytes of one expert, of every expert and of the layers' dense part; the decode step's cache of C experts
    per layer (C at least one working expert); and the expert bytes a token restores with no cache (its k
    experts in every layer; a cache saves its hit rate of that, which depends on the routing). The plans
    above it still hold each layer's experts with the layer: the budget does not yet leave them out."""
    cfg, layers = pebbled.model.config, expert_layers(pebbled)
    if not layers:
        return None
    per_expert = sum(t.nbytes for t in pebbled.layouts[layers[0]] if t.name in EXPERT_MATRICES) // cfg.n_expert
    total = sum(t.nbytes for i in layers for t in pebbled.layouts[i] if t.name in EXPERT_MATRICES)
    sizes = sorted({c for c in (0, 1, 8, 16, 32, cfg.n_expert) if c <= cfg.n_expert})
    return {"n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used, "expert_layers": len(layers),
            "expert_bytes": per_expert, "experts_bytes": total, "dense_bytes": pebbled.weight_bytes - total,
            "cache_bytes": {str(c): len(layers) * max(1, c) * per_expert for c in sizes},
            "routed_bytes_per_token": len(layers) * cfg.n_expert_used * per_expert}

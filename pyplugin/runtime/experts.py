"""Experts as pebbles: each expert of each layer of a mixture-of-experts model (its gate, up and down rows) an
entry of the store, and the decode step's slots for them (pebble_step_model's expert_policy).

A request asks for it with ``pebbling_expert_cache`` (at most that many experts of each layer kept on the
device; 0 streams every routed expert), ``pebbling_expert_prefetch`` (each layer's router guesses its
experts from the hidden state entering it, and they are restored early) and ``pebbling_expert_policy``
(which cached expert gives way: "lru", the least recently used, or "lfu", the least often used). The plan
then holds the dense part of each layer (attention, norms, router, shared expert) by the strategy's rule
and gives the rest of the budget to the cache (ExpertMemory): a smaller budget caches fewer experts. The
layers' merged expert tensors stay in the host tier (the store's keep_on_host), and an expert is read out of
them as it is restored (its rows of each), so the host holds every expert's bytes once: on the host library
they are the GGUF file's memory map itself. The report counts hits, misses, prefetch guesses and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import OptionsError
from ..store.kernels import EXPERT_MATRICES, EXPERT_POLICIES
from ..store.abi import aligned
from .layout import StoredTensor


def parse_expert_options(options: dict) -> tuple[int | None, bool, str]:
    """(pebbling_expert_cache, pebbling_expert_prefetch, pebbling_expert_policy) of a request's options."""
    value = options.get("pebbling_expert_cache")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 12):
        raise OptionsError(f"option 'pebbling_expert_cache': got {str(value)[:40]!r}; accepted: an integer from 0 "
                           "(every routed expert restored at each use) to 4096, the most experts of each layer kept "
                           "on the device (a smaller budget keeps fewer)")
    prefetch = options.get("pebbling_expert_prefetch", False)
    if not isinstance(prefetch, bool):
        raise OptionsError(f"option 'pebbling_expert_prefetch': got {str(prefetch)[:40]!r}; accepted: true or false")
    policy = options.get("pebbling_expert_policy", "lru")
    if policy not in EXPERT_POLICIES:
        raise OptionsError(f"option 'pebbling_expert_policy': got {str(policy)[:40]!r}; accepted: "
                           "'lru' (least recently used out) or 'lfu' (least often used out)")
    if value is None and (prefetch or "pebbling_expert_policy" in options):
        raise OptionsError("options 'pebbling_expert_prefetch' and 'pebbling_expert_policy' need "
                           "'pebbling_expert_cache' (experts as pebbles); accepted: an integer from 0 to 4096 beside them")
    return value, prefetch, policy


@dataclass(frozen=True)
class ExpertMemory:
    """What experts as pebbles cost on the device: the decoder's slots of one expert each, `cache` per layer
    of experts plus the staging slots (pebble_step_model: n_used with prefetch, else one where the cache is 0)."""

    layers: int       # layers of experts
    n_expert: int
    n_used: int       # experts a token runs in a layer
    slot_bytes: int   # one slot: the largest of the layers' experts (gate, up and down rows), aligned
    most: int         # experts per layer the request allows at most (pebbling_expert_cache)
    prefetch: bool
    routed_bytes: int = 0  # the experts a token runs, over every layer of experts (their gate, up and down rows)

    def staging(self, cache: int) -> int:
        return self.n_used if self.prefetch else 1 if cache == 0 else 0

    def device_bytes(self, cache: int) -> int:
        return self.slot_bytes * (self.layers * cache + self.staging(cache))

    def restored_bytes_per_token(self, cache: int) -> int:
        """The expert bytes a token restores with `cache` experts per layer (an estimate): what it runs that the
        cache misses, under uniform routing (a hit C / n_expert of the time; a real model's routing, with
        locality, hits more; prefetch's wrong guesses add theirs)."""
        return round(self.routed_bytes * (1 - min(cache, self.n_expert) / self.n_expert))

    def most_within(self, room: int) -> int:
        """The largest cache per layer, at most `most`, whose slots fit `room` bytes (0 where none more does)."""
        if room < self.device_bytes(1):
            return 0
        return min(self.most, self.n_expert, (room - self.slot_bytes * self.staging(1)) // (self.slot_bytes * self.layers))


def expert_layers(pebbled: Any) -> list[int]:
    """The layers of `pebbled` whose FFN is a mixture of experts."""
    return [i for i, layout in enumerate(pebbled.layouts) if {t.name for t in layout} >= set(EXPERT_MATRICES)]


def expert_bytes(pebbled: Any, i: int) -> int:
    """One expert of layer i: its gate, up and down rows as stored."""
    return sum(t.nbytes for t in pebbled.layouts[i] if t.name in EXPERT_MATRICES) // pebbled.model.config.n_expert


def expert_memory(pebbled: Any, pebbling: Any) -> ExpertMemory | None:
    """The request's ExpertMemory where it asks for experts as pebbles of a model that has them, else None."""
    cfg, layers = pebbled.model.config, expert_layers(pebbled)
    if pebbling is None or pebbling.expert_cache is None or not layers:
        return None
    slot = max(expert_bytes(pebbled, i) for i in layers)
    return ExpertMemory(len(layers), cfg.n_expert, cfg.n_expert_used, aligned(slot),
                        pebbling.expert_cache, pebbling.expert_prefetch,
                        sum(expert_bytes(pebbled, i) for i in layers) * cfg.n_expert_used)


def keep_merged_on_host(pebbled: Any, keep: bool) -> None:
    """The layers' merged expert tensors kept in the host tier (a plan of experts as pebbles), or placed by
    the strategy with their layers again."""
    if getattr(pebbled, "_merged_kept", False) == keep:
        return
    for i in expert_layers(pebbled):
        for t in pebbled.layouts[i]:
            if t.name in EXPERT_MATRICES:
                pebbled.store.keep_on_host(i, t.tensor_id, keep)
    pebbled._merged_kept = keep


def merged_entries(pebbled: Any, i: int) -> tuple[int, int, int]:
    """The store entries of layer i's merged gate, up and down expert tensors: where the decode step (and a
    prefill) read each expert from, its j-th n_expert-th of each (pebble_step_layer.experts_stored 2), so
    that the host tier holds every expert's bytes once."""
    ids = {t.name: t.tensor_id for t in pebbled.layouts[i]}
    return tuple(ids[name] for name in EXPERT_MATRICES)


def decoder_experts(layers: Any) -> dict[int, tuple[tuple[int, int, int], int]] | None:
    """For a StoreLayers whose plan holds experts as pebbles: {layer: (its merged expert tensors' entries,
    experts cached)} for the decoder (Kernels.decoder's `experts`); else None."""
    if layers.plan.expert_cache is None:
        return None
    return {i: (merged_entries(layers.pebbled, i), layers.plan.expert_cache) for i in expert_layers(layers.pebbled)}


class PrefillExperts:
    """moe_ffn's `experts` for layer i of a prefill where the arrays are device memory: expert j read
    out of the layer's merged tensors' entries into one working slot (the plan's workspace counts it) as
    each is asked for."""

    def __init__(self, pebbled: Any, i: int, slot: Any):
        cfg, self.pebbled, self.layer, self.slot = pebbled.model.config, pebbled, i, slot
        rows = {"ffn_gate_exps": cfg.n_ff_exp, "ffn_up_exps": cfg.n_ff_exp, "ffn_down_exps": cfg.n_embd}
        self.parts = [StoredTensor(t.tensor_id, t.name, (rows[t.name], t.shape[1]), t.nbytes // cfg.n_expert, t.qtype)
                      for name in EXPERT_MATRICES for t in pebbled.layouts[i] if t.name == name]
        self.nbytes = sum(t.nbytes for t in self.parts)

    def __call__(self, j: int) -> tuple:
        raw = self.slot[:self.nbytes]
        out, at = [], 0
        for t in self.parts:  # expert j's rows of each merged tensor, read from its entry
            self.pebbled.store.read(self.layer, t.tensor_id, j * t.nbytes, raw[at:at + t.nbytes])
            out.append(t.view(raw[at:at + t.nbytes], self.pebbled.dtype, self.pebbled.kernels))
            at += t.nbytes
        return tuple(out)


# ---------------------------------------------------------------------------------------------------
# what it cost

_COUNTS = {"expert_hits": "hits", "expert_misses": "misses", "expert_bytes_restored": "bytes",
           "expert_guesses": "guesses", "expert_guesses_right": "right", "expert_prefetches": "prefetches",
           "expert_prefetch_hits": "prefetch_hits"}


def charge(costs: dict, seqs, before: dict, after: dict) -> None:
    """Divides a step's expert counts (hits, misses, bytes, prefetch guesses) equally among its sequences."""
    share = 1 / len(seqs)
    for seq in seqs:
        cost = costs[seq]
        for stat, name in _COUNTS.items():
            cost.experts[name] = cost.experts.get(name, 0) + (after[stat] - before[stat]) * share
        cost.expert_steps += 1


def report(layers: Any, cost: Any) -> dict[str, Any] | None:
    """The report's "experts" object for a model of experts: the plan's cache per layer (None: experts part
    of their layers), the decoder's slots' bytes, hits, misses, the hit rate, prefetch guesses and their
    accuracy (guesses the layer then ran), and the expert bytes restored per decoded token."""
    cfg = layers.pebbled.model.config
    if not cfg.n_expert:
        return None
    c, plan = {k: round(v) for k, v in cost.experts.items()}, layers.plan
    ran = c.get("hits", 0) + c.get("misses", 0)
    guesses = c.get("guesses", 0)
    on = plan.expert_cache is not None
    return {"n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used, "cache_per_layer": plan.expert_cache,
            "cache_asked": layers.pebbling.expert_cache, "policy": layers.pebbling.expert_policy if on else None,
            "prefetch": layers.pebbling.expert_prefetch if on else None,
            "expert_bytes": max((expert_bytes(layers.pebbled, i) for i in expert_layers(layers.pebbled)), default=None),
            "cache_bytes_estimate": plan.expert_bytes if on else None,
            "cache_bytes": layers.expert_device_bytes() if on else None,
            "hits": c.get("hits", 0), "misses": c.get("misses", 0),
            "hit_rate": round(c["hits"] / ran, 4) if ran else None,
            "prefetch_guesses": guesses, "prefetch_right": c.get("right", 0),
            "prefetch_accuracy": round(c["right"] / guesses, 4) if guesses else None,
            "prefetched": c.get("prefetches", 0), "prefetched_used": c.get("prefetch_hits", 0),
            "bytes_restored_per_token": round(cost.experts.get("bytes", 0) / cost.expert_steps) if cost.expert_steps
            else None}


def estimate(pebbled: Any, e: ExpertMemory | None, dense: dict[str, int]) -> dict[str, Any] | None:
    """What experts as pebbles would hold and move, for `pebbling estimate` (None without experts), with
    slots of `e` and `dense` the peak of the dense part under "none" and "minimal" (the plans' peaks less
    their expert slots): the bytes of one expert, of every expert and of the dense part; the smallest budget
    (minimal's dense part and the staging slots: one expert, or one layer's top-k with prefetch); and per
    cache size what its slots cost, the budget it needs beside every layer's dense part resident ("none")
    and beside minimal's, and the expert bytes a token restores at most (no hit). A cache saves its hit
    rate of those; the hit rate depends on the routing (uniform routing hits about C / n_expert of the
    time, real routing more)."""
    cfg, layers = pebbled.model.config, expert_layers(pebbled)
    if not layers or e is None:
        return None
    total = sum(t.nbytes for i in layers for t in pebbled.layouts[i] if t.name in EXPERT_MATRICES)
    sizes = sorted({c for c in (0, 1, 8, 16, 32, 64, cfg.n_expert) if c <= cfg.n_expert})
    caches = []
    for c in sizes:
        row = {"cache_per_layer": c, "uniform_hit_rate": round(c / cfg.n_expert, 4)}
        for prefetch in (False, True):
            slots = ExpertMemory(e.layers, e.n_expert, e.n_used, e.slot_bytes, c, prefetch).device_bytes(c)
            key = "prefetch_" if prefetch else ""
            row.update({f"{key}slots_bytes": slots, f"{key}budget_none": dense["none"] + slots,
                        f"{key}budget_minimal": dense["minimal"] + slots})
        caches.append(row)
    routed = sum(expert_bytes(pebbled, i) for i in layers) * cfg.n_expert_used
    return {"n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used, "expert_layers": len(layers),
            "expert_bytes": max(expert_bytes(pebbled, i) for i in layers), "slot_bytes": e.slot_bytes,
            "experts_bytes": total, "dense_bytes": pebbled.weight_bytes - total,
            "smallest_budget_bytes": caches[0]["budget_minimal"],
            "smallest_budget_prefetch_bytes": caches[0]["prefetch_budget_minimal"],
            "caches": caches, "routed_bytes_per_token": routed}

"""The `pebbling` object of a response (DESIGN.md): what a request's plan cost, from the StoreLayers that
ran it: strategy, residency, estimated and measured peak memory, bytes restored, experts, batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..store import Strategy
from . import experts
from .layout import process_memory


@dataclass
class SequenceCost:
    """What one sequence's passes cost it: a pass's restored bytes and restores are divided equally among
    the sequences it ran (a prefill chunk runs one sequence, which pays for it all)."""

    bytes_restored: float = 0.0
    restores: float = 0.0
    passes: list[tuple[int, float, int]] = field(default_factory=list)  # (position, bytes share, sequences)
    # experts as pebbles (runtime.experts): this sequence's share of its decode steps' expert counts (hits,
    # misses, bytes restored, prefetch guesses ...), and how many steps
    experts: dict[str, float] = field(default_factory=dict)
    expert_steps: int = 0


def pebbling_report(layers: Any, stats: Any, seq: int = 0) -> dict[str, Any]:
    """The `pebbling` object of sequence `seq`'s final response (DESIGN.md). Memory is the batch's:
    the plan, its estimate and the peak hold every sequence the plan makes room for. Restored bytes
    are this sequence's share of the passes it took part in."""
    store = layers.store.stats()
    plan, memory = layers.plan, layers.plan.memory
    if layers.peak_sample:
        measured, how = layers.peak_sample, f"measured ({layers.measured_by})"
    else:
        measured = (store.device_peak_bytes + len(layers.slots) * layers.slot_bytes + memory.fixed_bytes
                    + memory.workspace_bytes + memory.overhead_bytes + layers.expert_device_bytes())
        how = ("byte-accounted (store device tier peak + working slots + output weights + "
               "workspace reservation + expert slots made; no GPU measured)")
    cost = layers.costs.get(seq, SequenceCost())
    # Decode steps are the forward passes that start past the prompt.
    prompt_end = stats.cached_tokens + stats.prompt_tokens
    decode = [(share, n) for pos, share, n in cost.passes if pos >= prompt_end]
    return {
        "strategy": _strategy_name(plan.strategy),
        "enabled": layers.pebbling.enabled is not False,
        "weights": layers.pebbled.weights,
        "kv_type": layers.kv.name,
        **({"kv_type_fallback": layers.kv_fallback} if layers.kv_fallback else {}),
        "kv_cache_bytes": memory.kv_cache_bytes(layers.n_ctx),
        "decode_step": "python" if layers.backend.name == "stub" else "native",
        "backend": layers.backend.name,
        "resident_layers": len(plan.resident),
        "resident": list(plan.resident),  # which layers, by index from 0: the rest streamed
        "n_layers": memory.n_layers,
        "budget_bytes": plan.budget_bytes,
        "estimated_peak_bytes": plan.estimated_peak_bytes,
        "measured_peak_bytes": int(measured),
        "measured_peak_how": how,
        "bytes_restored": round(cost.bytes_restored),
        "restores": round(cost.restores),
        "bytes_restored_per_token": int(sum(s for s, _ in decode) // len(decode)) if decode else None,
        "experts": experts.report(layers, cost),
        "cached_tokens": stats.cached_tokens,
        "context_shifts": stats.context_shifts,
        "cache_restored_tokens": stats.cache_restored,
        "batch": {"n_parallel": layers.n_seqs,
                  "largest": max((n for _, n in decode), default=1),
                  "mean": round(sum(n for _, n in decode) / len(decode), 2) if decode else 1.0},
        # What the whole process holds, beside the store's accounting above (which, on host memory,
        # counts each tier's bytes and not the interpreter, the model's own arrays or the tokenizer).
        **process_memory(),
    }


def _strategy_name(strategy: Strategy) -> str:
    return f"adaptive:{strategy.arg}" if strategy.name == "adaptive" else strategy.name

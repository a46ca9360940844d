"""What each strategy would cost a model before running it: `pebbling estimate`'s figures, and the server's
(/api/pebbling/estimate).

Peak device memory and bytes restored per token are estimates from the model's shape (the plan); the
speed is a prediction built from a restore bandwidth, the cost of one store call and a per-layer compute
time, measured through the store on this machine, in this run (measure.py). `budgets` is the same
prediction along adaptive's budgets: one point per number of resident layers, from the smallest footprint
(none resident) to every layer resident.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..errors import OptionsError
from ..kv_types import KV_TYPES
from ..store.strategy import ADAPTIVE, resident_layers
from . import experts
from .measure import Transfer, layer_decode_seconds, measure_restores, predict, store_calls_per_token
from .options import Options
from .pebbled import PebbledModel
from .plan import MemoryModel, PebblingOptions, make_plan, peak_for, smallest_footprint

STRATEGIES = ("none", "sqrt", "adaptive", "minimal", "every:2", "every:4")


def estimate(pebbled: PebbledModel, options: Options, limit: int | None, context_pos: int | None,
             parallel: int = 1, prompt_tokens: int | None = None,
             pebbling: PebblingOptions | None = None) -> dict[str, Any]:
    """Every strategy's plan against `limit` for `parallel` sequences decoding together (for a prompt of
    `prompt_tokens`, else any prompt), with a predicted slowdown from figures measured here (one sequence
    only: a batch's compute is not measured); `pebbling` asking for experts as pebbles plans them so."""
    pos = options.num_ctx // 2 if context_pos is None else context_pos
    if not 0 <= pos < options.num_ctx:
        raise OptionsError(f"--context-pos {pos}: must be from 0 to num_ctx - 1 = {options.num_ctx - 1}")
    if parallel < 1:
        raise OptionsError(f"--parallel {parallel}: must be at least 1")
    if prompt_tokens is not None and not 0 < prompt_tokens < options.num_ctx:
        raise OptionsError(f"--prompt-tokens {prompt_tokens}: must be from 1 to num_ctx - 1 = {options.num_ctx - 1}")
    memory = pebbled.memory_model(options, prompt_tokens, parallel, pebbling)
    check_limit(pebbled, options, memory, limit, prompt_tokens)
    # The entry a streamed layer's restore fills: one working slot.
    transfer = measure_restores(pebbled, make_plan(memory, "minimal").slot_bytes)
    t_layer = layer_decode_seconds(pebbled, options.num_ctx, pos)
    # On the GPU the backend's overhead grows as the measurements load kernels and libraries, as a
    # request's first steps would: one memory model taken after them serves every strategy, so the
    # rows compare like with like.
    memory = pebbled.memory_model(options, prompt_tokens, parallel, pebbling)
    none_peak = make_plan(memory, "none").estimated_peak_bytes
    adaptive_budget = pebbled.budget(PebblingOptions(memory_limit=limit))  # the limit, else free GPU memory

    # Each KV type this model's heads allow (a block type needs whole blocks per head).
    by_type = {t.name: pebbled.memory_model(replace(options, kv_type=t.name), None, parallel, pebbling)
               for t in KV_TYPES.values() if t.name != "f32" and pebbled.model.config.head_dim % t.block == 0}

    def plan_for(memory, name: str):
        budget = adaptive_budget if name == "adaptive" else limit
        try:
            return make_plan(memory, name, budget), None if budget is None else True
        except OptionsError:  # over the limit: still say what it would cost at the least (adaptive: minimal's;
            least = replace(memory, experts=memory.experts and replace(memory.experts, most=0))  # no expert cached)
            return make_plan(least, "minimal" if name == "adaptive" else name), False

    rows = {}
    for name in STRATEGIES:
        plan, fits = plan_for(memory, name)
        calls = store_calls_per_token(pebbled, plan)
        restored = pebbled.restored_bytes_per_token(plan, pos)
        prediction = predict(plan, restored, transfer, calls, t_layer, overlapped=pebbled.backend.copies_overlap) \
            if parallel == 1 else None
        rows[name] = {
            "plan": (f"adaptive:{plan.strategy.arg}" if plan.strategy.name == "adaptive"
                     else str(plan.strategy)),
            "resident_layers": len(plan.resident),
            "n_layers": memory.n_layers,
            "experts_cached_per_layer": plan.expert_cache,
            "estimated_peak_bytes": plan.estimated_peak_bytes,
            "reduction_pct": round(100 * (1 - plan.estimated_peak_bytes / none_peak), 1),
            "restored_bytes_per_token_estimate": restored,  # 0 where streamed layers are computed in place
            "streamed_bytes_per_token_estimate": plan.restored_bytes_per_token(pos),
            "store_calls_per_token": calls,
            "budget_bytes": plan.budget_bytes,
            "fits": fits,  # None: no budget to fit
            "predicted_seconds_per_token": prediction and prediction.seconds_per_token,
            "predicted_slowdown": prediction and round(prediction.slowdown, 3),
            "estimated_peak_bytes_by_kv_type": {t: plan_for(m, name)[0].estimated_peak_bytes for t, m in by_type.items()},
        }
    return {
        "random_weights": pebbled.model.random_weights,
        "backend": pebbled.backend.name,
        "copies_overlap": pebbled.backend.copies_overlap,
        "weights": pebbled.weights,
        "layer_weight_bytes": pebbled.weight_bytes,
        "n_layers": memory.n_layers,
        "num_ctx": options.num_ctx,
        "num_batch": options.num_batch,
        "parallel": parallel,
        "context_pos": pos,
        "memory_limit_bytes": limit,
        "smallest_footprint_bytes": smallest_footprint(memory),
        "smallest_footprint_for": memory.request,
        "restores": pebbled.backend.arrays_on_device,  # False: streamed layers are computed in place
        "kv_cache_bytes": memory.kv_cache_bytes(options.num_ctx),
        "kv_cache_bytes_without_windows": options.num_ctx * sum(
            memory.layer_kv_token_bytes or [memory.kv_bytes_per_token] * memory.n_layers),
        "kv_type": options.kv_type,
        # n_layer x positions (a sliding layer's window) x n_head_kv x head_dim x bytes a value, K and V
        "kv_cache_bytes_by_type": {t: m.kv_cache_bytes(options.num_ctx) for t, m in by_type.items()},
        # what each type saves: f16's bytes over the type's (a block type's scale included: 64/34, 64/18)
        "kv_cache_f16_over_type": {t: by_type["f16"].kv_bytes_per_token / m.kv_bytes_per_token
                                   for t, m in by_type.items()},
        "sliding_layers": sum(1 for w in memory.kv_windows if w),
        "kv_reading_layers": sum(1 for t in memory.layer_kv_token_bytes if not t),  # Gemma 4's: no caches of their own
        "sliding_window": max(memory.kv_windows, default=0),
        "experts": _experts(pebbled, memory if memory.experts else pebbled.memory_model(
            options, prompt_tokens, parallel, PebblingOptions(expert_cache=0))),
        "experts_as_pebbles": memory.experts is not None,
        "measured": {
            "restore_bytes_per_s": transfer.bytes_per_s,
            "restore_entry_bytes": transfer.entry_bytes,
            "restore_path": transfer.path,
            "store_call_seconds": transfer.call_seconds,
            "layer_decode_seconds": t_layer,
            "repeats": transfer.repeats,
        },
        "strategies": rows,
        "budgets": budget_curve(pebbled, memory, transfer, t_layer, pos),
    }


def budget_curve(pebbled: PebbledModel, memory: MemoryModel, transfer: Transfer, t_layer: float,
                 pos: int) -> list[dict[str, Any]]:
    """Adaptive along its budgets: for each number of resident layers k (0: minimal's smallest footprint, all:
    none's peak), the budget that holds k (its estimated peak) and the predicted time per token there (None
    for a batch, whose compute is not measured)."""
    points = []
    for k in range(memory.n_layers + 1):
        budget = peak_for(memory, resident_layers(ADAPTIVE, k, memory.n_layers))[0]
        plan = make_plan(memory, "adaptive", budget)
        if points and len(plan.resident) == points[-1]["resident_layers"]:
            continue  # a layer of no bytes: the same plan
        restored = pebbled.restored_bytes_per_token(plan, pos)
        prediction = predict(plan, restored, transfer, store_calls_per_token(pebbled, plan), t_layer,
                             overlapped=pebbled.backend.copies_overlap) if memory.n_seqs == 1 else None
        points.append({"resident_layers": len(plan.resident), "budget_bytes": budget,
                       "estimated_peak_bytes": plan.estimated_peak_bytes,
                       "restored_bytes_per_token_estimate": restored,
                       "streamed_bytes_per_token_estimate": plan.restored_bytes_per_token(pos),
                       "predicted_seconds_per_token": prediction and prediction.seconds_per_token})
    return points


def _experts(pebbled: PebbledModel, memory: MemoryModel) -> dict[str, Any] | None:
    """runtime.experts.estimate with the dense part's peaks under none and minimal."""
    plans = {name: make_plan(memory, name) for name in ("none", "minimal")}
    dense = {name: plan.estimated_peak_bytes - plan.expert_bytes for name, plan in plans.items()}
    return experts.estimate(pebbled, memory.experts, dense)


def check_limit(pebbled: PebbledModel, options: Options, memory: MemoryModel, limit: int | None,
                prompt_tokens: int | None) -> None:
    """A limit below the smallest footprint: one error naming it, and, planned for any prompt, the longest
    prompt the limit does hold (run and the server plan each request for its own prompt's length)."""
    try:
        make_plan(memory, "minimal", limit)
    except OptionsError as exc:
        if prompt_tokens is not None or memory.n_seqs > 1:
            raise
        longest = pebbled.longest_prompt_within(options, limit)
        if not longest:
            raise
        raise OptionsError(f"{exc}; it holds a request whose prompt is at most {longest} tokens, as run and "
                           f"the server plan each request for its prompt (--prompt-tokens {longest} plans "
                           "that one)") from None

"""`pebbling estimate MODEL`: what each strategy would cost before running it.

Peak device memory and bytes restored per token are estimates from the model's shape (the plan);
the slowdown is a prediction built from a restore bandwidth, the cost of one store call and a
per-layer compute time, which this command measures through the store on this machine, in this run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from ..errors import OptionsError
from ..kv_types import KV_TYPES
from ..runtime import Options, PebblingOptions, make_plan
from ..runtime.measure import layer_decode_seconds, measure_restores, predict, store_calls_per_token
from ..runtime import experts
from ..runtime.plan import format_bytes, parse_size, smallest_footprint
from .common import (Loaded, add_backend_argument, add_weights_argument, format_table, load_pebbled,
                     options_from_flags, plain)

STRATEGIES = ("none", "sqrt", "adaptive", "minimal", "every:2", "every:4")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("estimate", help="estimate each strategy's memory and predict its speed",
                              description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF file, 'pebbling-demo', NAME or NAME:TAG")
    p.add_argument("--num-ctx", type=int, help="context length in tokens (default 2048)")
    p.add_argument("--num-batch", type=int, help="prompt tokens per prefill chunk (default 512)")
    p.add_argument("--memory-limit", metavar="SIZE",
                   help="device memory budget, e.g. 512MiB or 6GiB: each strategy is checked against "
                        "it, and adaptive fills it")
    p.add_argument("--context-pos", type=int, metavar="N",
                   help="context position at which per-token figures are computed (default num_ctx/2: "
                        "the mean step of a generation that fills the context)")
    p.add_argument("--prompt-tokens", type=int, metavar="N",
                   help="plan for a request with a prompt of N tokens, as run and the server plan each request "
                        "(default: any prompt, prefill chunks of a full num_batch)")
    p.add_argument("--num-predict", type=int, metavar="N",
                   help="with --prompt-tokens: tokens the request generates (default -1: to the end of the context)")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="requests decoding together (the server's num_parallel): peaks hold N KV caches and "
                        "restored bytes are per token of a full batch; no speed is predicted for N > 1")
    p.add_argument("--kv-type", choices=[t for t in KV_TYPES if t != "f32"],
                   help="KV cache type of the main figures (default: PEBBLING_KV_CACHE_TYPE, else "
                        "OLLAMA_KV_CACHE_TYPE, else f16); every type's peak is shown beside them")
    p.add_argument("--expert-cache", type=int, metavar="C",
                   help="a mixture of experts' plans with experts as pebbles (pebbling_expert_cache): each layer's "
                        "dense part by the strategy, a cache of at most C experts per layer in the rest of the limit")
    p.add_argument("--expert-prefetch", action="store_true",
                   help="with --expert-cache: speculative prefetch's staging slots counted (pebbling_expert_prefetch)")
    add_weights_argument(p)
    add_backend_argument(p)
    p.add_argument("--json", action="store_true", help="print the same figures as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    limit = None if args.memory_limit is None else parse_size(args.memory_limit, "--memory-limit")
    loaded = load_pebbled(args.model, args.backend, args.pebbling_weights)
    try:
        options = options_from_flags(loaded.model, num_ctx=args.num_ctx, num_batch=args.num_batch,
                                     num_predict=args.num_predict, pebbling_kv_type=getattr(args, "kv_type", None))
        pebbling = PebblingOptions.from_options(
            {} if args.expert_cache is None else {"pebbling_expert_cache": args.expert_cache,
                                                  "pebbling_expert_prefetch": args.expert_prefetch})
        result = estimate(loaded, options, limit, args.context_pos, args.parallel, args.prompt_tokens, pebbling)
    finally:
        loaded.pebbled.close()
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def estimate(loaded: Loaded, options: Options, limit: int | None, context_pos: int | None,
             parallel: int = 1, prompt_tokens: int | None = None,
             pebbling: PebblingOptions | None = None) -> dict[str, Any]:
    """Every strategy's plan against `limit` for `parallel` sequences decoding together (for a prompt of
    `prompt_tokens`, else any prompt), with a predicted slowdown from figures measured here (one sequence
    only: a batch's compute is not measured); `pebbling` asking for experts as pebbles plans them so."""
    pebbled = loaded.pebbled
    pos = options.num_ctx // 2 if context_pos is None else context_pos
    if not 0 <= pos < options.num_ctx:
        raise OptionsError(f"--context-pos {pos}: must be from 0 to num_ctx - 1 = {options.num_ctx - 1}")
    if parallel < 1:
        raise OptionsError(f"--parallel {parallel}: must be at least 1")
    if prompt_tokens is not None and not 0 < prompt_tokens < options.num_ctx:
        raise OptionsError(f"--prompt-tokens {prompt_tokens}: must be from 1 to num_ctx - 1 = {options.num_ctx - 1}")
    memory = pebbled.memory_model(options, prompt_tokens, parallel, pebbling)
    check_limit(loaded, options, memory, limit, prompt_tokens)
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
        "model": loaded.path.stem,
        "path": str(loaded.path),
        "random_weights": loaded.model.random_weights,
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
        "kv_cache_bytes": sum(memory.kv_rows(i, options.num_ctx) for i in range(memory.n_layers))
        * memory.kv_bytes_per_token,
        "kv_cache_bytes_without_windows": memory.n_layers * options.num_ctx * memory.kv_bytes_per_token,
        "kv_type": options.kv_type,
        # n_layer x positions (a sliding layer's window) x n_head_kv x head_dim x bytes a value, K and V
        "kv_cache_bytes_by_type": {t: sum(m.kv_rows(i, options.num_ctx) for i in range(m.n_layers))
                                   * m.kv_bytes_per_token for t, m in by_type.items()},
        # what each type saves: f16's bytes over the type's (a block type's scale included: 64/34, 64/18)
        "kv_cache_f16_over_type": {t: by_type["f16"].kv_bytes_per_token / m.kv_bytes_per_token
                                   for t, m in by_type.items()},
        "sliding_layers": sum(1 for w in memory.kv_windows if w),
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
    }


def _experts(pebbled, memory) -> dict[str, Any] | None:
    """runtime.experts.estimate with the dense part's peaks under none and minimal."""
    plans = {name: make_plan(memory, name) for name in ("none", "minimal")}
    dense = {name: plan.estimated_peak_bytes - plan.expert_bytes for name, plan in plans.items()}
    return experts.estimate(pebbled, memory.experts, dense)


def check_limit(loaded: Loaded, options: Options, memory, limit: int | None, prompt_tokens: int | None) -> None:
    """A limit below the smallest footprint: one error naming it, and, planned for any prompt, the longest
    prompt the limit does hold (run and the server plan each request for its own prompt's length)."""
    try:
        make_plan(memory, "minimal", limit)
    except OptionsError as exc:
        if prompt_tokens is not None or memory.n_seqs > 1:
            raise
        longest = loaded.pebbled.longest_prompt_within(options, limit)
        if not longest:
            raise
        raise OptionsError(f"{exc}; it holds a request whose prompt is at most {longest} tokens, as run and "
                           f"the server plan each request for its prompt (--prompt-tokens {longest} plans "
                           "that one)") from None


def render(r: dict[str, Any]) -> str:
    m, limit, pos = r["measured"], r["memory_limit_bytes"], r["context_pos"]
    table = []
    for name, s in r["strategies"].items():
        if s["fits"] is None:
            fits = "no limit"
        elif s["fits"]:
            fits = "yes"
        else:
            fits = f"does not fit: needs {format_bytes(s['estimated_peak_bytes'])}"
        table.append([name, f"{s['resident_layers']}/{s['n_layers']}"
                      + ("" if s["experts_cached_per_layer"] is None else f", {s['experts_cached_per_layer']} exp."),
                      format_bytes(s["estimated_peak_bytes"]), f"{s['reduction_pct']:.1f}%",
                      format_bytes(s["restored_bytes_per_token_estimate"]),
                      "-" if s["predicted_slowdown"] is None else f"{s['predicted_seconds_per_token'] * 1e3:.2f}",
                      "-" if s["predicted_slowdown"] is None else f"{s['predicted_slowdown']:.2f}x",
                      *(format_bytes(b) for b in s["estimated_peak_bytes_by_kv_type"].values()), fits])
    adaptive = r["strategies"]["adaptive"]
    adaptive_budget = ("no budget: every layer resident" if adaptive["budget_bytes"] is None else
                       f"budget {format_bytes(adaptive['budget_bytes'])}"
                       + ("" if limit is not None else " (free GPU memory less a reserve)"))
    random = " (random weights)" if r["random_weights"] else ""
    return "\n".join([
        f"{r['model']}{random}: {r['n_layers']} layers, backend {r['backend']}, "
        f"num_ctx {r['num_ctx']}, num_batch {r['num_batch']}"
        + (f", {r['parallel']} requests decoding together" if r["parallel"] > 1 else ""),
        f"weights: {r['weights']}, {format_bytes(r['layer_weight_bytes'])} in the layers as held"
        + (" (their GGUF types)" if r["weights"] == "quantized" else " (expanded at load)"),
        f"memory limit: {'none' if limit is None else format_bytes(limit)}; smallest footprint "
        f"(minimal) for {r['smallest_footprint_for']}: {format_bytes(r['smallest_footprint_bytes'])} (estimate)",
        f"KV cache at num_ctx: {format_bytes(r['kv_cache_bytes'])} in {r['kv_type']} (estimate; "
        + ", ".join(f"{t} {format_bytes(b)}" + _kv_ratio(r, t) for t, b in r["kv_cache_bytes_by_type"].items())
        + ")" + (
            f"; {r['sliding_layers']} of {r['n_layers']} layers attend over a window of {r['sliding_window']} "
            f"positions and keep only that, saving "
            f"{format_bytes(r['kv_cache_bytes_without_windows'] - r['kv_cache_bytes'])}"
            if r["sliding_layers"] else ""),
        *_kv_block_note(r),
        *_expert_lines(r["experts"], r["experts_as_pebbles"]),
        f"measured in this run (median of {m['repeats']}):",
        f"  restore bandwidth   {m['restore_bytes_per_s'] / 1e9:.2f} GB/s  "
        f"({format_bytes(m['restore_entry_bytes'])} entry, {m['restore_path']})",
        f"  one store call      {m['store_call_seconds'] * 1e6:.1f} µs  (a 256-byte restore)",
        f"  one layer, decode   {m['layer_decode_seconds'] * 1e3:.3f} ms  (context position {pos})",
        "",
        format_table(["strategy", "resident", "peak (estimate)", "vs none", "restored/token (estimate)",
                      "ms/token (predicted)", "slowdown (predicted)",
                      *(f"peak, KV {t}" for t in r["kv_cache_bytes_by_type"]), "fits the limit"], table),
        "",
        "restored/token: no layer on this backend: a streamed layer is computed from the host tier in place "
        "(its arrays are host memory), so its weights are not copied."
        if not r["restores"] else
        f"restored/token: weights of the streamed layers + their KV rows 0..{pos - 1} (a sliding layer's: "
        f"its window's), for a decode step at context position {pos}." if r["sliding_layers"] else
        f"restored/token: weights of the streamed layers + their KV rows 0..{pos - 1}, for a decode "
        f"step at context position {pos}"
        + (f"; a step of {r['parallel']} sequences restores the weights once, so each token pays 1/"
           f"{r['parallel']} of them and its own KV rows. Peaks hold {r['parallel']} KV caches. No speed "
           "is predicted for a batch (its compute is not measured here)." if r["parallel"] > 1 else "."),
        *(["restored/token also counts the routed experts a plan's expert cache (C exp.) misses, copied into "
           "the decoder's expert slots on every backend: under uniform routing a cache of C hits C / n_expert "
           "of the time (a real model's routing hits more)."]
          if any(s["experts_cached_per_layer"] is not None for s in r["strategies"].values()) else []),
        "ms/token: the layer stack only (embedding, output and sampling left out); calls = store calls "
        "per token (a restore per streamed weight tensor, K and V read and written per streamed layer); "
        + ("copies overlap compute: max(L x layer + calls x call, restored/bandwidth + layer)."
           if r["copies_overlap"] else
           "on this backend copies do not overlap compute: L x layer + calls x call + restored/bandwidth."),
        f"adaptive: {adaptive_budget}; keeps {adaptive['resident_layers']} of {r['n_layers']} layers "
        "resident.",
    ])


def _expert_lines(e: dict[str, Any] | None, apart: bool) -> list[str]:
    if e is None:
        return []
    table = format_table(
        ["cache/layer", "slots", "budget, dense resident", "budget, dense minimal", "with prefetch: slots",
         "dense resident", "dense minimal", "uniform-routing hit rate"],
        [[str(c["cache_per_layer"]), *(format_bytes(c[k]) for k in (
            "slots_bytes", "budget_none", "budget_minimal", "prefetch_slots_bytes", "prefetch_budget_none",
            "prefetch_budget_minimal")), f"{c['uniform_hit_rate']:.3f}"] for c in e["caches"]])
    return [f"experts: {e['n_expert']} per layer in {e['expert_layers']} layers, {e['n_expert_used']} used per token; "
            f"one expert {format_bytes(e['expert_bytes'])}, all {format_bytes(e['experts_bytes'])}, the dense part "
            f"{format_bytes(e['dense_bytes'])}",
            f"  experts as pebbles (pebbling_expert_cache): smallest budget {format_bytes(e['smallest_budget_bytes'])} "
            f"(the dense part under minimal + one expert slot), {format_bytes(e['smallest_budget_prefetch_bytes'])} "
            f"with prefetch (+ one layer's top {e['n_expert_used']}); a token restores at most "
            f"{format_bytes(e['routed_bytes_per_token'])} of experts (every routed expert missed), and a cache saves "
            "its hit rate of that. What each cache size costs (estimate):",
            *("    " + line for line in table.splitlines()),
            "  the plans below hold " + ("the dense part by each strategy and cache experts in the rest (C exp.)"
                                         if apart else "each layer's experts with the layer (--expert-cache C: as "
                                         "pebbles)")]


def _kv_ratio(r: dict, name: str) -> str:
    ratio = r["kv_cache_f16_over_type"][name]
    return "" if ratio == 1 else f" ({ratio:.2f}x less than f16)"


def _kv_block_note(r: dict) -> list[str]:
    """Why a block type saves less than its bits say: each block of values carries an fp16 scale."""
    f16 = KV_TYPES["f16"]
    blocks = [f"{t.name} {t.row_bytes(t.block)} bytes per {t.block} values where f16 takes {f16.row_bytes(t.block)}"
              for t in map(KV_TYPES.get, r["kv_cache_bytes_by_type"]) if t.quantized]
    return [f"  {'; '.join(blocks)} (an fp16 scale with each block, as in llama.cpp's formats)"] if blocks else []

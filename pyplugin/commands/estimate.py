"""`pebbling estimate MODEL`: what each strategy would cost before running it (runtime/estimate.py).

Peak device memory and bytes restored per token are estimates from the model's shape (the plan);
the slowdown is a prediction built from a restore bandwidth, the cost of one store call and a
per-layer compute time, which this command measures through the store on this machine, in this run.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..kv_types import KV_TYPES
from ..runtime import Options, PebblingOptions
from ..runtime.estimate import estimate as estimate_pebbled
from ..runtime.plan import format_bytes, parse_size
from .common import (Loaded, add_backend_argument, add_weights_argument, format_table, load_pebbled,
                     options_from_flags, plain)


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
    """runtime.estimate's figures for the loaded model, named with its file."""
    return {"model": loaded.path.stem, "path": str(loaded.path),
            **estimate_pebbled(loaded.pebbled, options, limit, context_pos, parallel, prompt_tokens, pebbling)}


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
            if r["sliding_layers"] else "") + (
            f"; {r['kv_reading_layers']} layers attend over an earlier layer's caches and keep none"
            if r.get("kv_reading_layers") else ""),
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

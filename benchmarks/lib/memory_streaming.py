"""Streaming cost per strategy on one random-weight Llama: tokens, peak memory, decode speed, and how
close decode under a streaming strategy comes to the transfer bound.

    python benchmarks/memory.py streaming [--backend cuda] [--n-layer 16] [--n-embd 2048] [--n-ff 8192]
                                          [--prompt-tokens 32] [--decode-tokens 24] [--json FILE]

For each strategy: greedy tokens compared with `none`'s, the report's peak device memory (measured by
NVML on the GPU, byte-accounted on host/stub) beside the estimate, decode ms per token, bytes restored
per decoded token, and efficiency = (bytes restored per token / bandwidth) / measured time per token,
where the bandwidth is pinned host-to-device through pebble_restore measured in the same run. An
efficiency of 1.0 means decode runs exactly at the transfer bound.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from lib.memory_store import measure as measure_bandwidth
from pyplugin.runtime import PebbledModel
from pyplugin.model import load_model
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions, make_plan, smallest_footprint
from pyplugin.model.synth import write_gguf


def run(pebbled: PebbledModel, options: Options, prompt: list[int], pebbling: PebblingOptions) -> dict:
    gen = pebbled.generation(options, pebbling, len(prompt))
    tokens = list(gen.tokens(prompt))
    report = gen.report()
    decoded = max(gen.stats.generated_tokens, 1)
    return {"tokens": tokens, "report": report, "decode_ms_per_token": gen.stats.generate_ns / decoded / 1e6,
            "prefill_tokens_per_s": gen.stats.prompt_tokens / (gen.stats.prompt_ns / 1e9)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cuda", "host", "stub"))
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-ff", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "bench.gguf", arch="llama", n_layer=args.n_layer, n_embd=args.n_embd,
                          n_head=args.n_embd // 128, n_head_kv=max(1, args.n_embd // 256), n_ff=args.n_ff,
                          n_ctx=1024, weight_type="F16", seed=3)
        model = load_model(path, weights="f16", progress=False)
    pebbled = PebbledModel(model, backend=args.backend)
    options = Options(temperature=0, num_predict=args.decode_tokens, num_ctx=args.prompt_tokens + args.decode_tokens + 8,
                      num_batch=args.prompt_tokens)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.n_vocab, args.prompt_tokens)]

    memory = pebbled.memory_model(options)
    layer_mib = max(1, max(memory.layer_weight_bytes) >> 20)
    bandwidth = measure_bandwidth(pebbled.backend, layer_mib, repeats=10)
    h2d = bandwidth["h2d_restore_GBps"] * 1e9
    full = make_plan(memory, "none").estimated_peak_bytes
    floor = smallest_footprint(memory)
    cases = [("none", None), ("sqrt", None), ("every:2", None),
             ("adaptive", int(floor + 0.5 * (full - floor))), ("adaptive", int(floor + 0.25 * (full - floor))),
             ("minimal", None)]

    run(pebbled, options, prompt, PebblingOptions.from_options({"pebbling_strategy": "none"}))  # warm-up
    rows, reference = [], None
    for strategy, budget in cases:
        pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy, "pebbling_memory_limit": budget})
        result = run(pebbled, options, prompt, pebbling)
        report = result["report"]
        reference = reference or result["tokens"]
        per_token = report["bytes_restored_per_token"] or 0
        bound_ms = per_token / h2d * 1e3
        rows.append({
            "strategy": report["strategy"], "budget_bytes": budget,
            "tokens_equal_none": result["tokens"] == reference,
            "estimated_peak_bytes": report["estimated_peak_bytes"],
            "measured_peak_bytes": report["measured_peak_bytes"], "measured_how": report["measured_peak_how"],
            "peak_over_estimate": report["measured_peak_bytes"] / report["estimated_peak_bytes"],
            "within_budget": budget is None or report["measured_peak_bytes"] <= budget,
            "decode_ms_per_token": result["decode_ms_per_token"],
            "prefill_tokens_per_s": result["prefill_tokens_per_s"],
            "bytes_restored_per_token": per_token, "transfer_bound_ms": bound_ms,
            "efficiency": bound_ms / result["decode_ms_per_token"] if per_token else None,
        })

    params = sum(a.size for lw in model.layers for _, a in lw.arrays())
    print(f"model: random-weight llama, {args.n_layer} layers x {args.n_embd}, {params / 1e6:.0f}M layer "
          f"parameters, backend {pebbled.backend.name}; restore bandwidth {bandwidth['h2d_restore_GBps']} GB/s "
          f"(measured, {layer_mib} MiB entries)")
    print(f"{'strategy':<12}{'same':>6}{'peak MiB':>11}{'est MiB':>10}{'ratio':>7}{'ms/tok':>9}"
          f"{'MiB/tok':>9}{'bound ms':>10}{'effic.':>8}")
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] else "-"
        print(f"{r['strategy']:<12}{'yes' if r['tokens_equal_none'] else 'NO':>6}"
              f"{r['measured_peak_bytes'] / 2**20:>11.1f}{r['estimated_peak_bytes'] / 2**20:>10.1f}"
              f"{r['peak_over_estimate']:>7.3f}{r['decode_ms_per_token']:>9.2f}"
              f"{r['bytes_restored_per_token'] / 2**20:>9.1f}{r['transfer_bound_ms']:>10.2f}{eff:>8}")
    print(f"peak: {rows[0]['measured_how']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows, "n_layer": args.n_layer, "n_embd": args.n_embd,
                       "n_ff": args.n_ff, "layer_parameters": int(params)}, f, indent=2)
    pebbled.close()

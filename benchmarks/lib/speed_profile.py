"""Where a decode step's time goes on the host backend: inside the native step (pebble_decoder_step) or in
the Python around it (embedding, sampling, accounting), on a random-weight file of a real model's shape.

    python benchmarks/speed.py profile [--shape smollm2-135m] [--type Q4_K_M] [--context 300] [--tokens 64]
        [--runs 3] [--n-layer N] [--dir DIR] [--json FILE] [--attention-contexts 1000,4000] [--kv-type f16,q8_0]

Each run prefills --context random tokens, then decodes --tokens greedy tokens through Generation.decode_one
(what the server calls), timing every call into the library's decode step with a wrapper around
NativeDecoder.step. It prints, per run, the decode rate, the share of decode time spent inside the native
step, the Python time per token outside it, and the Python-to-native calls per step (counted on the
library's handle; they do not grow with the layer count: tests/test_decode_step.py). The wrapper's own
cost (a few microseconds a step) is counted as native time. Every figure is measured in this run.

It also times the decode step's attention alone (pebble_attend, the same code the step runs per layer) for
one token over caches of the shape's heads filled to each of --attention-contexts rows: over the same
caches again and again (in the CPU's caches), milliseconds per layer and per token (all layers) and
nanoseconds per cached row per KV head; and over every layer's caches in turn, as a decode step reads them
(from memory where they outgrow the CPU's caches), milliseconds per layer and per token.

--kv-type takes KV cache types (comma-separated): each run measures each type in turn, over the same
prompt, and the rates are compared with the first type's (a decode rate ratio, and the attention's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from lib import shapes
from lib.speed_cpu import cpu_model


class _Counting:
    """The library's handle, with its pebble_* calls counted."""

    def __init__(self, lib):
        self._lib, self.calls = lib, 0

    def __getattr__(self, name):
        if name.startswith("pebble_"):
            self.calls += 1
        return getattr(self._lib, name)


def profile(path: Path, context: int, tokens: int, runs: int, kv_types: tuple[str, ...] = ("f16",)) -> dict:
    """Per KV type, one result per run (the types measured in turn within each run, so that a machine's
    drift falls on all of them alike)."""
    from pyplugin.model import load_model  # noqa: PLC0415 - imported where measured
    from pyplugin.runtime import PebbledModel
    from pyplugin.runtime.options import Options
    from pyplugin.runtime.plan import PebblingOptions
    from pyplugin.store import native_kernels

    pebbled = PebbledModel(load_model(path, weights="quantized", progress=False), backend="host")
    inside = [0.0]
    step = native_kernels.NativeDecoder.step

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    native_kernels.NativeDecoder.step = timed
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 30000, context)]
    results = {kv: [] for kv in kv_types}
    try:
        for _, kv in ((r, kv) for r in range(runs) for kv in kv_types):
            options = Options(temperature=0, num_ctx=context + tokens + 8, num_batch=min(context, 512),
                              num_predict=tokens, kv_type=kv)
            gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "none"}), context)
            token = int(np.argmax(gen.prefill(prompt)))
            token = int(np.argmax(gen.decode_one(token)))  # the first step makes the plan's decoder
            counting = _Counting(pebbled.kernels.lib._lib)
            store_counting = _Counting(pebbled.store._lib)
            pebbled.kernels.lib._lib, pebbled.store._lib = counting, store_counting
            inside[0] = 0.0
            start = time.perf_counter()
            for _ in range(tokens - 1):
                token = int(np.argmax(gen.decode_one(token)))
            total = time.perf_counter() - start
            pebbled.kernels.lib._lib, pebbled.store._lib = counting._lib, store_counting._lib
            n = tokens - 1
            results[kv].append({"decode_tok_per_s": n / total, "native_share": inside[0] / total,
                            "python_ms_per_token": 1e3 * (total - inside[0]) / n,
                            "native_calls_per_step": (counting.calls + store_counting.calls) / n})
    finally:
        native_kernels.NativeDecoder.step = step
        pebbled.close()
    return results


def attention_cost(shape: dict, contexts: list[int], repeats: int = 20, kv_type: str = "f16") -> list[dict]:
    """pebble_attend of one token over `context` cached rows of kv_type, timed two ways: over the same caches
    again and again (in the CPU's caches: the median of `repeats` calls), and over each of n_layer layers'
    caches in turn, as a decode step reads them (from memory, where they exceed the CPU's caches: the
    median over `repeats` // 4 passes through the layers)."""
    from pyplugin.kv_types import KV_TYPES, encode  # noqa: PLC0415
    from pyplugin.store import backend_named  # noqa: PLC0415

    kernels = backend_named("host").kernels
    n_head, n_head_kv, n_layer = shape["n_head"], shape["n_head_kv"], shape["n_layer"]
    head_dim = shape.get("key_length") or shape["n_embd"] // n_head
    rng, out = np.random.default_rng(0), []
    for context in contexts:
        q = rng.standard_normal((1, n_head, head_dim)).astype(np.float32)
        one = tuple(encode(rng.standard_normal((context, n_head_kv, head_dim)).astype(np.float32), KV_TYPES[kv_type])
                    for _ in range(2))
        layers = [[tuple(c.copy() for c in one)] for _ in range(n_layer)]  # the same values, n_layer places
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            kernels.attend(q, layers[0], [context], n_head_kv, 1.0 / head_dim ** 0.5)
            times.append(time.perf_counter() - start)
        passes = []
        for _ in range(max(1, repeats // 4)):
            start = time.perf_counter()
            for caches in layers:
                kernels.attend(q, caches, [context], n_head_kv, 1.0 / head_dim ** 0.5)
            passes.append((time.perf_counter() - start) / n_layer)
        per_layer, from_memory = statistics.median(times), statistics.median(passes)
        out.append({"context": context, "ms_per_layer": 1e3 * per_layer,
                    "ms_per_token": 1e3 * per_layer * n_layer,
                    "ns_per_row_per_kv_head": 1e9 * per_layer / context / n_head_kv,
                    "ms_per_layer_from_memory": 1e3 * from_memory,
                    "ms_per_token_from_memory": 1e3 * from_memory * n_layer})
        del layers
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(shapes.SHAPES))
    parser.add_argument("--type", default="Q4_K_M", choices=sorted(shapes.FILES))
    parser.add_argument("--context", type=int, default=300, help="prompt tokens before the decode")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n-layer", type=int, help="fewer layers than the shape has (a quick run)")
    parser.add_argument("--dir", help="where the GGUF file is written and kept (default: a temporary folder)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--attention-contexts", default="1000,4000",
                        help="cached rows the attention alone is timed over (comma-separated; empty: none)")
    parser.add_argument("--kv-type", default="f16", help="KV cache types, comma-separated (f16, q8_0, q4_0, f32)")
    args = parser.parse_args(argv)
    kv_types = tuple(t.strip() for t in args.kv_type.split(",") if t.strip())

    with tempfile.TemporaryDirectory(prefix="pebbling-profile-") as tmp:
        directory = Path(args.dir) if args.dir else Path(tmp)
        path = shapes.write_files(directory, [args.type], args.shape, args.n_layer)[args.type]
        by_type = profile(path, args.context, args.tokens, args.runs, kv_types)
    n_layer = args.n_layer or shapes.SHAPES[args.shape]["n_layer"]
    contexts = [int(c) for c in args.attention_contexts.split(",") if c.strip()]
    shape = {**shapes.SHAPES[args.shape], "n_layer": n_layer}
    result = {"shape": args.shape, "type": args.type, "n_layer": n_layer, "context": args.context,
              "tokens": args.tokens, "cpu": cpu_model(), "kv_types": {}}
    print(f"{args.shape} shape, {n_layer} layers, {args.type} (random weights), host backend, a {args.context}-token "
          f"context, {args.tokens} greedy tokens; CPU: {result['cpu']} (all measured here)")
    for kv, runs in by_type.items():
        attention = attention_cost(shape, contexts, kv_type=kv)
        result["kv_types"][kv] = report_type(kv, runs, attention, n_layer)
    first = result["kv_types"][kv_types[0]]
    for kv in kv_types[1:]:
        this = result["kv_types"][kv]
        this["decode_vs_first"] = this["median"]["decode_tok_per_s"] / first["median"]["decode_tok_per_s"]
        print(f"  KV {kv} decodes at {this['decode_vs_first']:.3f}x the {kv_types[0]} rate (medians)" + "".join(
            f"; attention over {a['context']} rows at {b['ms_per_layer'] / a['ms_per_layer']:.3f}x its speed"
            for a, b in zip(this["attention"], first["attention"])))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def report_type(kv: str, runs: list[dict], attention: list[dict], n_layer: int) -> dict:
    """Prints one KV type's runs and attention timings; returns them with their medians."""
    print(f" KV cache {kv}:")
    for i, r in enumerate(runs):
        print(f"  run {i + 1}: decode {r['decode_tok_per_s']:.1f} tok/s, {100 * r['native_share']:.1f}% of it inside "
              f"pebble_decoder_step, Python outside it {r['python_ms_per_token']:.2f} ms/token, "
              f"{r['native_calls_per_step']:g} native calls per step")
    m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"  median: {100 * m['native_share']:.1f}% native, {100 * (1 - m['native_share']):.1f}% Python "
          f"({m['python_ms_per_token']:.2f} ms/token), {m['native_calls_per_step']:g} native calls per step")
    for a in attention:
        print(f"  attention alone over {a['context']} cached rows: {a['ms_per_layer']:.3f} ms a layer in the CPU's "
              f"caches, {a['ms_per_token']:.2f} ms a token ({n_layer} layers), {a['ns_per_row_per_kv_head']:.2f} ns "
              f"per row per KV head; each layer's caches in turn, as a step reads them: "
              f"{a['ms_per_layer_from_memory']:.3f} ms a layer, {a['ms_per_token_from_memory']:.2f} ms a token")
    return {"runs": runs, "median": m, "attention": attention}


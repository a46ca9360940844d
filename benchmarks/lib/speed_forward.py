"""Prefill and decode speed of the forward pass on a ~100M-parameter random-weight Llama.

    python benchmarks/speed.py forward [--xp numpy|cupy|all] [--prompt-tokens 256]
                                       [--decode-tokens 32] [--type F16] [--weights f16|quantized]
                                       [--json FILE]

Writes the model with pyplugin.model.synth into a temporary directory, loads it, and times prefill (one
chunk of --prompt-tokens) and greedy decode (--decode-tokens steps) with all layers resident. numpy
computes in float32, CuPy in float16; `all` runs CuPy too when it is usable here. --weights picks the
form the matrices are held in: f16 (expanded at load, the default here) or quantized (their GGUF
type, computed by the quantized kernels). Figures are
measurements of this run (the median of --repeats); nothing is assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pyplugin.runtime import Generation, ResidentLayers
from pyplugin.store import backend_named, select_backend
from pyplugin.model import load_model
from pyplugin.runtime.options import Options
from pyplugin.model.synth import write_gguf
from pyplugin.xp import array_module, cupy_usable

# 12 layers of 768 with a 3072 feed-forward and 4 KV heads: ~105M parameters.
SPEC = dict(arch="llama", n_layer=12, n_embd=768, n_head=12, n_head_kv=4, n_ff=3072, n_ctx=2048,
            vocab="llama3", n_merges=300, seed=1)


def parameters(model) -> int:
    outer = {id(a): a for a in vars(model.outer).values()}.values()
    return sum(a.size for lw in model.layers for _, a in lw.arrays()) + sum(a.size for a in outer)


def measure(model, xp_name: str, prompt_tokens: int, decode_tokens: int, repeats: int) -> dict:
    xp = array_module(xp_name)
    kernels = backend_named("cuda").kernels if xp_name == "cupy" else select_backend().host_kernels
    options = Options(temperature=0, num_ctx=prompt_tokens + decode_tokens + 1, num_batch=prompt_tokens)
    prompt = list(np.random.default_rng(0).integers(0, model.config.n_vocab, prompt_tokens))
    prefill_s, decode_s = [], []
    for run in range(repeats + 1):             # run 0 warms up (allocation, device upload, BLAS)
        gen = Generation(model, options, layers=ResidentLayers(model, options.num_ctx, kernels))
        t0 = time.perf_counter()
        logits = gen.prefill(prompt)
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            logits = gen.decode_one(int(np.argmax(logits)))
        t2 = time.perf_counter()
        if run:
            prefill_s.append(t1 - t0)
            decode_s.append(t2 - t1)
    return {"xp": xp_name, "dtype": "float32" if xp is np else "float16",
            "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "repeats": repeats,
            "prefill_tokens_per_s": round(prompt_tokens / statistics.median(prefill_s), 1),
            "decode_tokens_per_s": round(decode_tokens / statistics.median(decode_s), 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--xp", choices=("numpy", "cupy", "all"), default="all")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--type", default="F16", help="GGUF type of the weight matrices (default F16)")
    p.add_argument("--weights", choices=("f16", "quantized"), default="f16",
                   help="f16: expanded at load (default); quantized: matrices kept in --type")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)

    names = ["numpy", "cupy"] if args.xp == "all" else [args.xp]
    if args.xp == "all" and not cupy_usable():
        names = ["numpy"]
        print("CuPy is not usable here: numpy only")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "bench.gguf", weight_type=args.type, **SPEC)
        t0 = time.perf_counter()
        model = load_model(path, weights=args.weights, progress=False)
        load_s = time.perf_counter() - t0
        file_mb = path.stat().st_size / 1e6
    cfg = model.config
    print(f"model: random-weight llama, {parameters(model) / 1e6:.1f}M parameters, {cfg.n_layer} "
          f"layers x {cfg.n_embd}, {cfg.n_head}/{cfg.n_head_kv} heads, ffn {cfg.n_ff}, {args.type} "
          f"file {file_mb:.0f} MB, weights {args.weights}, loaded in {load_s:.2f} s; {os.cpu_count()} CPUs")
    results = []
    for name in names:
        r = measure(model, name, args.prompt_tokens, args.decode_tokens, args.repeats)
        results.append(r)
        print(f"{name:5} ({r['dtype']}): prefill {r['prompt_tokens']} tokens: "
              f"{r['prefill_tokens_per_s']:>8.1f} tokens/s   decode: {r['decode_tokens_per_s']:>7.2f} "
              f"tokens/s  (median of {r['repeats']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model_parameters": parameters(model), "type": args.type,
                                               "weights": args.weights,
                                               "results": results}, indent=2))


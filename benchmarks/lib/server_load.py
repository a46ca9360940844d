"""Continuous batching, measured: 8 clients decoding 64 tokens each at once against the same requests sent
one at a time, on a model streamed with `minimal` (every layer restored for every decode step).

    python benchmarks/server.py load [--clients 8] [--tokens 64] [--backend host] [--json FILE]
        [--shape NAME --type Q4_K_M] [--strategy minimal]

--shape writes a random-weight file of a real model's shape (lib/shapes.py's: SmolLM2-135M,
Gemma-3-270M, Qwen3-0.6B, Qwen2.5-1.5B, ...) in --type (Q4_K_M: llama.cpp's mix with its fallbacks,
Q8_0 or Q4_1) in place of the small llama of --n-layer/--n-embd/--n-ff/--weight-type.

Runs `pebbling serve` in a process of its own on loopback (so that the clients' threads do not share its
interpreter) with PEBBLING_NUM_PARALLEL set to the number of clients, OPENBLAS_NUM_THREADS to
--blas-threads (1: on a few shared cores OpenBLAS's own threads spin against the server's), and a small
random-weight model written for the run. Each phase runs --repeats times, alternating which goes first,
and the fastest run of each is compared (the machine may be shared). Every figure printed is measured in
this run: the aggregate decode rate (generated tokens over the wall time of the whole phase, prefills
and HTTP included), the server process's CPU time in it, and the bytes restored per generated token (the
sum of the responses' `bytes_restored`, prefills included, over their tokens; and the mean of their
decode-only `bytes_restored_per_token`). Each request's answer is compared with the same request's
answer alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from lib import serve, shapes
from lib.serve import PROMPTS, cpu_seconds
from pyplugin.model.synth import write_gguf

# Times the serial aggregate rate on the host backend: 4x for the small default model streamed with minimal;
# 3x on a real model's shape (--shape), whose steps are dearer per token and gain less from batching.
GOAL, SHAPE_GOAL = 4.0, 3.0


def start_server(models: str, backend: str, parallel: int, blas_threads: int) -> tuple[subprocess.Popen, str]:
    return serve.start_server(models, {
        "PEBBLING_BACKEND": backend, "PEBBLING_NUM_PARALLEL": str(parallel),
        "OPENBLAS_NUM_THREADS": str(blas_threads), "OMP_NUM_THREADS": str(blas_threads)})


def body(client: int, tokens: int, strategy: str = "minimal") -> dict:
    return {"model": "bench", "prompt": PROMPTS[client % len(PROMPTS)], "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": tokens, "pebbling_strategy": strategy,
                        "pebbling_cache_prompt": False}}


def ask(url: str, payload: dict) -> dict:
    r = requests.post(f"{url}/api/generate", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()


def phase(url: str, bodies: list[dict], concurrent: bool, pid: int) -> dict:
    cpu, start = cpu_seconds(pid), time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: ask(url, b), bodies))
    else:
        answers = [ask(url, b) for b in bodies]
    wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    tokens = sum(a["eval_count"] for a in answers)
    per_token = [a["pebbling"]["bytes_restored_per_token"] for a in answers
                 if a["pebbling"]["bytes_restored_per_token"] is not None]
    return {"answers": answers, "wall_s": wall, "server_cpu_s": cpu, "generated_tokens": tokens,
            "aggregate_tok_per_s": tokens / wall, "tok_per_server_cpu_s": tokens / cpu if cpu else None,
            "bytes_restored_per_generated_token": sum(a["pebbling"]["bytes_restored"] for a in answers) / tokens,
            "decode_bytes_restored_per_token_mean": sum(per_token) / len(per_token),
            "largest_batch": max(a["pebbling"]["batch"]["largest"] for a in answers)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--backend", default="host")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-ff", type=int, default=384)
    parser.add_argument("--weight-type", default="Q8_0")
    parser.add_argument("--shape", choices=sorted(shapes.SHAPES),
                        help="a real model's shape (random weights) in place of the small llama above")
    parser.add_argument("--type", default="Q4_K_M", choices=sorted(shapes.FILES),
                        help="the weights' types with --shape")
    parser.add_argument("--strategy", default="minimal", help="pebbling_strategy of every request")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OPENBLAS_NUM_THREADS for the server (prefill's GEMMs): on a few shared cores "
                             "OpenBLAS's spinning threads made a 20 x 256 x 768 product 100x slower")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each phase, alternating which goes first; the fastest of each is reported")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pebbling-bench-") as models:
        if args.shape:
            shape = shapes.SHAPES[args.shape]
            write_gguf(Path(models) / "bench.gguf", **shape, n_ctx=4096, **shapes.FILES[args.type](shape))
            model = {"shape": args.shape, **{k: v for k, v in shape.items() if k != "vocab"}, "types": args.type}
        else:
            serve.write_small_llama(Path(models) / "bench.gguf", args.n_layer, args.n_embd, args.n_ff, args.weight_type)
            model = {"arch": "llama", "n_layer": args.n_layer, "n_embd": args.n_embd, "n_ff": args.n_ff,
                     "weight_type": args.weight_type}
        server, url = start_server(models, args.backend, args.clients, args.blas_threads)
        try:
            bodies = [body(c, args.tokens, args.strategy) for c in range(args.clients)]
            ask(url, body(0, 2, args.strategy))  # loaded and warm
            runs = []
            for n in range(args.repeats):  # alternating, so that a busy moment does not favour one side
                done = {c: phase(url, bodies, concurrent=c, pid=server.pid)
                        for c in ((False, True) if n % 2 == 0 else (True, False))}
                runs.append((done[False], done[True]))
            serial = min((r[0] for r in runs), key=lambda p: p["wall_s"])
            batched = min((r[1] for r in runs), key=lambda p: p["wall_s"])
        finally:
            server.terminate()
            server.wait(timeout=30)

    alone = [a["response"] for a in runs[0][0]["answers"]]
    same = all([a["response"] for a in p["answers"]] == alone for pair in runs for p in pair)
    speedup = batched["aggregate_tok_per_s"] / serial["aggregate_tok_per_s"]
    # None where nothing is restored at all (host memory: weights and KV computed from the host tier in place)
    restored_ratio = (batched["bytes_restored_per_generated_token"] / serial["bytes_restored_per_generated_token"]
                      if serial["bytes_restored_per_generated_token"] else None)
    report = batched["answers"][0]["pebbling"]
    result = {
        "model": {**model, "weights": "random"},
        "backend": report["backend"], "strategy": report["strategy"], "clients": args.clients,
        "num_predict": args.tokens, "num_parallel": args.clients, "blas_threads": args.blas_threads,
        "serial": {k: v for k, v in serial.items() if k != "answers"},
        "batched": {k: v for k, v in batched.items() if k != "answers"},
        "speedup": speedup, "bytes_restored_ratio": restored_ratio, "same_answers": same,
        "goal_speedup": SHAPE_GOAL if args.shape else GOAL,
        "repeats": args.repeats,
        "speedup_per_repeat": [b["aggregate_tok_per_s"] / a["aggregate_tok_per_s"] for a, b in runs],
        "cpu_speedup": (batched["tok_per_server_cpu_s"] / serial["tok_per_server_cpu_s"]
                        if batched["tok_per_server_cpu_s"] and serial["tok_per_server_cpu_s"] else None),
    }
    described = (f"{args.shape} shape, {args.type}" if args.shape else
                 f"llama, {args.n_layer} layers, n_embd {args.n_embd}, n_ff {args.n_ff}, {args.weight_type}")
    print(f"model: {described} (random weights); backend {result['backend']}, strategy {result['strategy']}, OPENBLAS_NUM_THREADS "
          f"{args.blas_threads}; {args.clients} clients x "
          f"{args.tokens} tokens (measured; the fastest of {args.repeats} runs of each phase)")
    for name, p in (("one at a time", serial), ("concurrent", batched)):
        print(f"  {name:14s} {p['generated_tokens']:4d} tokens in {p['wall_s']:6.2f} s = "
              f"{p['aggregate_tok_per_s']:7.1f} tok/s aggregate ({p['server_cpu_s']:.2f} s of server CPU); bytes "
              f"restored per generated token "
              f"{p['bytes_restored_per_generated_token']:,.0f} "
              f"(decode steps alone {p['decode_bytes_restored_per_token_mean']:,.0f});"
              f" largest batch {p['largest_batch']}")
    print(f"  speedup {speedup:.2f}x (goal >= {result['goal_speedup']:.0f}x on the host backend; each run: "
          + ", ".join(f"{x:.2f}x" for x in result["speedup_per_repeat"])
          + (f"; per server CPU second {result['cpu_speedup']:.2f}x" if result["cpu_speedup"] else "")
          + "); bytes restored per token "
          + (f"{restored_ratio:.3f} of serial" if restored_ratio is not None else "none either way (computed in place)")
          + f"; same answers as alone: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {args.json}")
    return result


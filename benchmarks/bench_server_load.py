"""Continuous batching, measured: 8 clients decoding 64 tokens each at once against the same requests sent
one at a time, on a model streamed with `minimal` (every layer restored for every decode step).

    python benchmarks/bench_server_load.py [--clients 8] [--tokens 64] [--backend host] [--json FILE]

Runs `pebbling serve` in a process of its own on loopback (so that the clients' threads do not share
its interpreter) with PEBBLING_NUM_PARALLEL set to the number of clients and a small random-weight model
written for the run. Every figure printed is measured in this run: the aggregate decode rate (generated
tokens over the wall time of the whole phase, prefills and HTTP included), and the bytes restored per
generated token (the sum of the responses' `bytes_restored`, prefills included, over their tokens; and
the mean of their decode-only `bytes_restored_per_token`). Each request's answer is compared with the
same request's answer alone.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyplugin.model.synth import write_gguf  # noqa: E402

GOAL = 4.0  # times the serial aggregate rate, on the host backend
PROMPTS = ("Why is the sky blue?", "Tell me a story about a fox.", "List three prime numbers.", "Hello there",
           "What is a pebble?", "Explain batching in one line.", "Count from one to ten.", "Good morning!")


def start_server(models: str, backend: str, parallel: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)  # this tree's pyplugin, whatever is installed
    env = {**os.environ, "PEBBLING_BACKEND": backend, "PEBBLING_NUM_PARALLEL": str(parallel),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "pyplugin.cli", "serve", "--port", str(port), "--models", models],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            requests.get(url, timeout=1)
            return server, url
        except requests.ConnectionError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the server did not start")
            time.sleep(0.1)


def body(client: int, tokens: int) -> dict:
    return {"model": "bench", "prompt": PROMPTS[client % len(PROMPTS)], "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": tokens, "pebbling_strategy": "minimal",
                        "pebbling_cache_prompt": False}}


def ask(url: str, payload: dict) -> dict:
    r = requests.post(f"{url}/api/generate", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()


def phase(url: str, bodies: list[dict], concurrent: bool) -> dict:
    start = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: ask(url, b), bodies))
    else:
        answers = [ask(url, b) for b in bodies]
    wall = time.perf_counter() - start
    tokens = sum(a["eval_count"] for a in answers)
    per_token = [a["pebbling"]["bytes_restored_per_token"] for a in answers
                 if a["pebbling"]["bytes_restored_per_token"] is not None]
    return {"answers": answers, "wall_s": wall, "generated_tokens": tokens,
            "aggregate_tok_per_s": tokens / wall,
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
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pebbling-bench-") as models:
        write_gguf(Path(models) / "bench.gguf", arch="llama", n_layer=args.n_layer, n_embd=args.n_embd,
                   n_head=max(1, args.n_embd // 64), n_head_kv=max(1, args.n_embd // 128), n_ff=args.n_ff,
                   n_ctx=512, weight_type=args.weight_type, n_merges=200)
        server, url = start_server(models, args.backend, args.clients)
        try:
            bodies = [body(c, args.tokens) for c in range(args.clients)]
            ask(url, body(0, 2))  # loaded and warm
            serial = phase(url, bodies, concurrent=False)
            batched = phase(url, bodies, concurrent=True)
        finally:
            server.terminate()
            server.wait(timeout=30)

    same = [a["response"] for a in serial["answers"]] == [a["response"] for a in batched["answers"]]
    speedup = batched["aggregate_tok_per_s"] / serial["aggregate_tok_per_s"]
    restored_ratio = (batched["bytes_restored_per_generated_token"] / serial["bytes_restored_per_generated_token"])
    report = batched["answers"][0]["pebbling"]
    result = {
        "model": {"arch": "llama", "n_layer": args.n_layer, "n_embd": args.n_embd, "n_ff": args.n_ff,
                  "weight_type": args.weight_type, "weights": "random"},
        "backend": report["backend"], "strategy": report["strategy"], "clients": args.clients,
        "num_predict": args.tokens, "num_parallel": args.clients,
        "serial": {k: v for k, v in serial.items() if k != "answers"},
        "batched": {k: v for k, v in batched.items() if k != "answers"},
        "speedup": speedup, "bytes_restored_ratio": restored_ratio, "same_answers": same, "goal_speedup": GOAL,
    }
    print(f"model: llama, {args.n_layer} layers, n_embd {args.n_embd}, n_ff {args.n_ff}, {args.weight_type} "
          f"(random weights); backend {result['backend']}, strategy {result['strategy']}; {args.clients} clients x "
          f"{args.tokens} tokens (measured)")
    for name, p in (("one at a time", serial), ("concurrent", batched)):
        print(f"  {name:14s} {p['generated_tokens']:4d} tokens in {p['wall_s']:6.2f} s = "
              f"{p['aggregate_tok_per_s']:7.1f} tok/s aggregate; bytes restored per generated token "
              f"{p['bytes_restored_per_generated_token']:,.0f} (decode steps alone {p['decode_bytes_restored_per_token_mean']:,.0f});"
              f" largest batch {p['largest_batch']}")
    print(f"  speedup {speedup:.2f}x (goal >= {GOAL:.0f}x on the host backend); bytes restored per token "
          f"{restored_ratio:.3f} of serial; same answers as alone: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {args.json}")
    return result


if __name__ == "__main__":
    main()

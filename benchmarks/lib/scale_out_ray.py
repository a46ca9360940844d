"""Replicas on Ray Serve, measured: the aggregate decode rate of 1 and of 2 replicas under 8 clients, and
what the route through Ray (proxy, front, request router, replica) adds to a request over a direct server.

    python benchmarks/scale_out.py [--clients 8] [--tokens 64] [--replicas 1,2] [--demo] [--json FILE]

One local Ray cluster with as many CPUs as this process may run on; each replica reserves an equal share
of them (and the host library runs that many threads in it). A small random-weight llama is written for
the run, or with --demo the demo model (pebbling-demo) is served. The direct server is `pebbling serve` in a process of its own on loopback. Every figure is
measured in this run:
- routing overhead: the median latency of --requests one-token generations sent one after another
  (prompt cached, so almost all of it is HTTP and routing), through Ray with one replica, minus the same
  against the direct server;
- aggregate tok/s: generated tokens over the wall time of --clients concurrent requests of --tokens
  each (prefills and HTTP included), the best of --repeats runs, direct and through Ray per replica count.
The machine's cores and its load average are printed beside the figures: on a few cores that other work
shares, two replicas cannot run twice as fast as one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from lib.serve import PROMPTS, free_port, start_server, write_small_llama
from pyplugin.serving.registry import DEMO_NAME, DEMO_SPEC

def body(model: str, client: int, tokens: int) -> dict:
    return {"model": model, "prompt": f"{PROMPTS[client % len(PROMPTS)]} (client {client})", "raw": True,
            "stream": False, "options": {"temperature": 0, "num_predict": tokens,
                                         # a prompt split differently rounds differently: whole prefills,
                                         # so answers compare whatever ran before on each server
                                         "pebbling_cache_prompt": False}}


def ask(session: requests.Session, url: str, payload: dict) -> dict:
    r = session.post(f"{url}/api/generate", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()


def latency_ms(url: str, model: str, requests_n: int) -> float:
    """Median ms of one-token generations of one cached prompt, one after another."""
    payload = {"model": model, "prompt": "ping", "raw": True, "stream": False,
               "options": {"temperature": 0, "num_predict": 1}}
    times = []
    with requests.Session() as session:
        ask(session, url, payload)
        for _ in range(requests_n):
            start = time.perf_counter()
            ask(session, url, payload)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def aggregate(url: str, model: str, clients: int, tokens: int, repeats: int) -> dict:
    """The best of `repeats` runs of `clients` concurrent requests: tok/s and which replicas answered."""
    best = None
    for _ in range(repeats):
        sessions = [requests.Session() for _ in range(clients)]
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda c: ask(sessions[c], url, body(model, c, tokens)), range(clients)))
        wall = time.perf_counter() - start
        generated = sum(a["eval_count"] for a in answers)
        run = {"wall_s": wall, "generated_tokens": generated, "tok_per_s": generated / wall,
               "answers": [a["response"] for a in answers]}
        best = run if best is None or run["tok_per_s"] > best["tok_per_s"] else best
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--replicas", default="1,2", help="replica counts to measure, comma-separated")
    parser.add_argument("--requests", type=int, default=40, help="sequential requests for the routing overhead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-ff", type=int, default=1536)
    parser.add_argument("--demo", action="store_true", help="serve the demo model (pebbling-demo) instead")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        import ray
        from ray import serve

        from pyplugin.serving.ray_deploy import build_app
    except ImportError as exc:
        sys.exit(f"scale_out.py needs Ray Serve: pip install 'pebbling[ray]' ({exc})")

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load_before = os.getloadavg()[0]
    counts = [int(n) for n in args.replicas.split(",")]
    shape = ({k: DEMO_SPEC[k] for k in ("arch", "n_layer", "n_embd", "n_ff")} if args.demo
             else {"arch": "llama", "n_layer": args.n_layer, "n_embd": args.n_embd, "n_ff": args.n_ff})
    model = DEMO_NAME if args.demo else "bench"
    result = {"cores": cores, "load_average_before": load_before, "clients": args.clients, "tokens": args.tokens,
              "model": {"name": model, **shape}}
    with tempfile.TemporaryDirectory(prefix="pebbling-bench-") as models:
        if not args.demo:
            write_small_llama(Path(models) / "bench.gguf", args.n_layer, args.n_embd, args.n_ff)
        # One setting for the direct server and the replicas (which inherit this process's environment):
        # requests decoding together, and OpenBLAS held to one thread (its spinning threads on a few
        # shared cores slowed prefill's products many times over; `server.py load`).
        env = {"PEBBLING_NUM_PARALLEL": str(args.clients), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        os.environ.update(env)
        server, url = start_server(models, env)
        try:
            result["direct"] = {"latency_ms": latency_ms(url, model, args.requests),
                                **aggregate(url, model, args.clients, args.tokens, args.repeats)}
        finally:
            server.terminate()
            server.wait(timeout=30)

        ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        try:
            for n in counts:
                serve.run(build_app({"models": models, "num_replicas": n, "num_cpus": cores / n}),
                          name="pebbling", route_prefix="/")
                aggregate(url, model, max(args.clients, 2 * n), 2, 1)  # every replica loads the model
                run = {"latency_ms": latency_ms(url, model, args.requests) if n == 1 else None,
                       **aggregate(url, model, args.clients, args.tokens, args.repeats)}
                result[f"ray_{n}"] = run
                serve.delete("pebbling")
        finally:
            serve.shutdown()
            ray.shutdown()
    result["load_average_after"] = os.getloadavg()[0]

    direct = result["direct"]
    print(f"cores: {cores}; load average {load_before:.2f} before the run, {result['load_average_after']:.2f} "
          f"after (a load above {cores} before it: other work held the cores too, and this run got a share)")
    print(f"model: {model}, {shape['arch']} {shape['n_layer']} layers, n_embd {shape['n_embd']}, Q8_0; "
          f"{args.clients} clients x {args.tokens} tokens")
    print(f"{'server':<16}{'tok/s':>10}{'vs direct':>11}{'1-token ms':>12}")
    print(f"{'direct':<16}{direct['tok_per_s']:>10.1f}{1:>11.2f}{direct['latency_ms']:>12.2f}")
    for n in counts:
        run = result[f"ray_{n}"]
        ms = f"{run['latency_ms']:.2f}" if run["latency_ms"] is not None else "-"
        print(f"{f'ray, {n} replica' + ('s' if n > 1 else ''):<16}{run['tok_per_s']:>10.1f}"
              f"{run['tok_per_s'] / direct['tok_per_s']:>11.2f}{ms:>12}")
        run["same_answers_as_direct"] = run["answers"] == direct["answers"]
    if 1 in counts:
        result["routing_overhead_ms"] = result["ray_1"]["latency_ms"] - direct["latency_ms"]
        print(f"routing overhead per request through Ray: {result['routing_overhead_ms']:.2f} ms")
    if 1 in counts and 2 in counts:
        result["speedup_2_over_1"] = result["ray_2"]["tok_per_s"] / result["ray_1"]["tok_per_s"]
        print(f"2 replicas over 1: {result['speedup_2_over_1']:.2f}x")
    print("answers equal to the direct server's: " +
          ", ".join(f"{n} replica(s) {result[f'ray_{n}']['same_answers_as_direct']}" for n in counts))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


"""Concurrent clients against pebbling's HTTP API: requests per second, latency, tokens per second.

    python benchmarks/server.py clients                       # starts its own server on loopback
    python benchmarks/server.py clients --url http://127.0.0.1:11435 --model pebbling-demo \\
        --clients 8 --requests 25 --num-predict 16 --strategies none,sqrt,minimal

Each client sends its requests one after another; the latencies are what the clients saw, from any server
(--url) or one of this tree in this process (the demo model). `server.py load` measures what decoding
requests together gains over sending them one at a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import requests


def local_server():
    from server_patch import create_app
    from server_patch.local import serving

    return serving(create_app())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start one on loopback)")
    p.add_argument("--model", default="pebbling-demo")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=25, help="per client")
    p.add_argument("--num-predict", type=int, default=16)
    p.add_argument("--strategies", default="none", help="comma list, used in turn")
    args = p.parse_args(argv)
    strategies = args.strategies.split(",")

    with (local_server() if args.url is None else _given(args.url)) as url:
        body = {"model": args.model, "prompt": "Why is the sky blue?", "stream": False,
                "options": {"temperature": 0, "num_predict": args.num_predict}}
        requests.post(f"{url}/api/generate", json=body, timeout=600).raise_for_status()  # load it

        def client(c: int) -> list[tuple[float, int]]:
            out = []
            with requests.Session() as session:
                for i in range(args.requests):
                    options = {**body["options"], "pebbling_strategy": strategies[(c + i) % len(strategies)]}
                    start = time.perf_counter()
                    r = session.post(f"{url}/api/generate", json={**body, "options": options}, timeout=600)
                    r.raise_for_status()
                    out.append((time.perf_counter() - start, r.json()["eval_count"]))
            return out

        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = [x for per_client in pool.map(client, range(args.clients)) for x in per_client]
        elapsed = time.perf_counter() - start

    latencies = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    print(f"{len(results)} requests from {args.clients} clients to {args.model} "
          f"(num_predict {args.num_predict}, strategies {args.strategies}) in {elapsed:.2f} s")
    print(f"  {len(results) / elapsed:.1f} requests/s, {tokens / elapsed:.1f} generated tokens/s")
    print(f"  latency p50 {statistics.median(latencies) * 1e3:.0f} ms, "
          f"p95 {latencies[int(0.95 * (len(latencies) - 1))] * 1e3:.0f} ms, max {latencies[-1] * 1e3:.0f} ms")


@contextmanager
def _given(url: str):
    yield url.rstrip("/")


"""A bounded load test on loopback: 8 concurrent clients x 50 requests over two models, mixed
endpoints, strategies, memory limits and options, all greedy. No request may fail, every response must
equal the one the same request gets when requests run one at a time (batched requests share a pass over
the layers, never a cache), requests do decode in batches, and none is planned past its memory limit.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pyplugin.model import load_model
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import Options, PebbledModel
from pyplugin.runtime.plan import smallest_footprint
from pyplugin.store import probe
from server_patch import create_app
from server_patch.local import serving

CLIENTS, REQUESTS_PER_CLIENT = 8, 50
STRATEGIES = ("none", "sqrt", "minimal", "every:2", "adaptive", None)
PROMPTS = ("Hello", "Why is the sky blue?", "The quick brown fox", "Numbers such as 12 and 345", "Café")


def request_for(client: int, i: int, limit: int) -> tuple[str, dict]:
    """The i-th request of a client: (path, body), varied but deterministic; every fifth asks for adaptive
    within `limit` bytes."""
    n = client * REQUESTS_PER_CLIENT + i
    # Each request prefills its whole prompt: a prefix found in the cache would make its tokens depend on
    # which request ran before it (the rounding of a prompt split differently), and this test pins down
    # that concurrency changes nothing. test_prefix_cache.py covers the cache.
    options = {"temperature": 0, "num_predict": 1 + n % 6, "repeat_penalty": (1.0, 1.1, 1.3)[n % 3],
               "pebbling_cache_prompt": False}
    if STRATEGIES[n % len(STRATEGIES)]:
        options["pebbling_strategy"] = STRATEGIES[n % len(STRATEGIES)]
    if n % 5 == 0:
        options.update(pebbling_strategy="adaptive", pebbling_memory_limit=limit)
    model, prompt, stream = ("a", "b")[n % 2], PROMPTS[n % len(PROMPTS)], n % 4 == 0
    kind = n % 3
    if kind == 0:
        return "/api/generate", {"model": model, "prompt": prompt, "options": options, "stream": stream}
    if kind == 1:
        return "/api/chat", {"model": model, "messages": [{"role": "user", "content": prompt}],
                             "options": options, "stream": stream}
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                    "temperature": 0, "max_tokens": options["num_predict"],
                                    "options": {k: v for k, v in options.items() if k.startswith("pebbling")}}


REPORTS: list[tuple[dict, dict]] = []  # (options, pebbling report) of every response that has one


def outcome(session: requests.Session, url: str, path: str, body: dict) -> tuple:
    """What must not depend on concurrency: the text, the token count and the stop reason."""
    r = session.post(url + path, json=body, stream=body.get("stream", False), timeout=60)
    assert r.status_code == 200, r.text
    if path == "/v1/chat/completions":
        data = r.json()
        REPORTS.append((body["options"], data["pebbling"]))
        return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]
    if not body["stream"]:
        data = r.json()
        REPORTS.append((body["options"], data["pebbling"]))
        text = data["response"] if path == "/api/generate" else data["message"]["content"]
        return text, data["eval_count"], data["done_reason"], data.get("context")
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert not any("error" in line for line in lines), lines
    REPORTS.append((body["options"], lines[-1]["pebbling"]))
    text = "".join(line["response"] if path == "/api/generate" else line["message"]["content"]
                   for line in lines)
    return text, lines[-1]["eval_count"], lines[-1]["done_reason"], lines[-1].get("context")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_clients_get_what_they_get_alone(tmp_path, monkeypatch):
    for name, seed in (("a", 1), ("b", 2)):
        write_gguf(tmp_path / f"{name}.gguf", arch="llama", n_layer=4, n_embd=32, n_head=2, n_head_kv=1,
                   n_ff=64, n_ctx=512, seed=seed)
    # A backend that accounts bytes, for the server and the limit alike: a GPU's measured footprint (its
    # context and library handles, hundreds of MiB) moves by MiBs between requests, far more than the
    # two-versus-four-sequence gap of this tiny model. test_batching.py batches on the GPU.
    backend = "host" if probe("host").usable else "stub"
    monkeypatch.setenv("PEBBLING_BACKEND", backend)
    # A limit that holds the smallest footprint of two sequences but not of four: adaptive requests with
    # it batch two at a time.
    model = load_model(tmp_path / "a.gguf", progress=False)
    pebbled, options = PebbledModel(model, backend=backend), Options.from_dict({}, n_ctx_train=512)
    limit = smallest_footprint(pebbled.memory_model(options, n_seqs=2))
    assert smallest_footprint(pebbled.memory_model(options, n_seqs=4)) > limit
    pebbled.close()
    app = create_app(models_dir=tmp_path)
    plan = [[request_for(c, i, limit) for i in range(REQUESTS_PER_CLIENT)] for c in range(CLIENTS)]
    with serving(app) as url:
        with requests.Session() as session:
            alone = [[outcome(session, url, *req) for req in client] for client in plan]

        def client(requests_of_client):
            with requests.Session() as session:
                return [outcome(session, url, *req) for req in requests_of_client]

        deepest, done = 0, threading.Event()

        def watch_queues():  # proves requests really did wait for each other
            nonlocal deepest
            while not done.is_set():
                deepest = max([deepest] + [m.active for m in app.state.engine.running()])
                time.sleep(0.001)

        watcher = threading.Thread(target=watch_queues)
        watcher.start()
        try:
            REPORTS.clear()
            with ThreadPoolExecutor(CLIENTS) as pool:
                together = list(pool.map(client, plan))
        finally:
            done.set()
            watcher.join()
    assert together == alone
    assert deepest >= 2
    assert app.state.engine.counts["failed"] == 0
    assert len(REPORTS) == CLIENTS * REQUESTS_PER_CLIENT
    assert max(report["batch"]["largest"] for _, report in REPORTS) >= 2  # requests did decode together
    limited = [report for options, report in REPORTS if "pebbling_memory_limit" in options]
    assert limited and all(max(r["estimated_peak_bytes"], r["measured_peak_bytes"]) <= limit for r in limited)
    assert {r["batch"]["n_parallel"] for r in limited} == {2}  # fewer sequences, not a larger peak

"""A bounded load test on loopback: 8 concurrent clients x 50 requests over two models, mixed
endpoints, strategies and options, all greedy. No request may fail, and every response must equal
the one the same request gets when requests run one at a time: queued requests never share a cache.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving

CLIENTS, REQUESTS_PER_CLIENT = 8, 50
STRATEGIES = ("none", "sqrt", "minimal", "every:2", "adaptive", None)
PROMPTS = ("Hello", "Why is the sky blue?", "The quick brown fox", "Numbers such as 12 and 345", "Café")


def request_for(client: int, i: int) -> tuple[str, dict]:
    """The i-th request of a client: (path, body), varied but deterministic."""
    n = client * REQUESTS_PER_CLIENT + i
    # Each request prefills its whole prompt: a prefix found in the cache would make its tokens depend on
    # which request ran before it (the rounding of a prompt split differently), and this test pins down
    # that concurrency changes nothing. test_prefix_cache.py covers the cache.
    options = {"temperature": 0, "num_predict": 1 + n % 6, "repeat_penalty": (1.0, 1.1, 1.3)[n % 3],
               "pebbling_cache_prompt": False}
    if STRATEGIES[n % len(STRATEGIES)]:
        options["pebbling_strategy"] = STRATEGIES[n % len(STRATEGIES)]
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


def outcome(session: requests.Session, url: str, path: str, body: dict) -> tuple:
    """What must not depend on concurrency: the text, the token count and the stop reason."""
    r = session.post(url + path, json=body, stream=body.get("stream", False), timeout=60)
    assert r.status_code == 200, r.text
    if path == "/v1/chat/completions":
        data = r.json()
        return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]
    if not body["stream"]:
        data = r.json()
        text = data["response"] if path == "/api/generate" else data["message"]["content"]
        return text, data["eval_count"], data["done_reason"], data.get("context")
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert not any("error" in line for line in lines), lines
    text = "".join(line["response"] if path == "/api/generate" else line["message"]["content"]
                   for line in lines)
    return text, lines[-1]["eval_count"], lines[-1]["done_reason"], lines[-1].get("context")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_clients_get_what_they_get_alone(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        write_gguf(tmp_path / f"{name}.gguf", arch="llama", n_layer=4, n_embd=32, n_head=2, n_head_kv=1,
                   n_ff=64, n_ctx=512, seed=seed)
    app = create_app(models_dir=tmp_path)
    plan = [[request_for(c, i) for i in range(REQUESTS_PER_CLIENT)] for c in range(CLIENTS)]
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
            with ThreadPoolExecutor(CLIENTS) as pool:
                together = list(pool.map(client, plan))
        finally:
            done.set()
            watcher.join()
    assert together == alone
    assert deepest >= 2
    assert app.state.engine.counts["failed"] == 0

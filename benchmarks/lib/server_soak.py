"""A soak of the server: clients that never stop, for minutes, doing everything a server meets in a day.

    python benchmarks/server.py soak                          # 20 minutes, 8 clients
    python benchmarks/server.py soak --minutes 2 --json soak.json

`pebbling serve` runs in a process of its own, over a small synthetic model, with Ollama's store in a
temporary directory and a registry on loopback (tests/registry.py) whose downloads are sometimes cut off.
Each client picks, at random (seeded), among: generate and chat (streamed and not), a stream cut after its
first lines, embeddings, a request with keep_alive 0 (the model unloaded), a pull (and the model deleted
again), a pull abandoned by its client, create from a model with a system prompt, copy and delete, and
listing (tags, ps, show). Every 10 s the server's resident memory, threads and open files are sampled
(/proc). At the end, after the clients stop and the server has idled: the figures, and whether the run
held: no unexpected 5xx (a 5xx is expected of nothing here), resident memory at the end within 64 MiB of
its value after the first minute, and no more threads or open files than then.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import requests

from lib import ROOT
from lib.serve import proc_figures, start_server

RSS_SLACK = 64 * 2**20
MODEL = dict(arch="llama", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_ctx=512, seed=7)
GREEDY = {"temperature": 0, "num_predict": 8}


class Soak:
    def __init__(self, url: str, registry, seed: int, digests: dict[str, str]):
        self.url, self.registry, self.seed, self.digests = url, registry, seed, digests
        self.statuses: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.refused: list[str] = []  # 4xx answers: each should be the client's fault, and say so
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def record(self, kind: str, status: int, text: str = "") -> None:
        with self.lock:
            self.statuses[f"{kind} {status}"] += 1
            if status >= 500:
                self.unexpected.append(f"{kind} {status}: {text[:200]}")
            elif status >= 400 and len(self.refused) < 20:
                self.refused.append(f"{kind} {status}: {text[:200]}")

    def client(self, n: int) -> None:
        rnd = random.Random(self.seed * 100 + n)
        actions = [self.generate, self.chat_stream, self.cut_stream, self.embed, self.unload, self.pull_delete,
                   self.abandoned_pull, self.create_copy_delete, self.listing]
        weights = [4, 4, 2, 2, 1, 1, 1, 1, 3]
        while not self.stop.is_set():
            action = rnd.choices(actions, weights)[0]
            try:
                action(rnd, n)
            except requests.RequestException as exc:
                if action is not self.abandoned_pull:
                    with self.lock:
                        self.unexpected.append(f"{action.__name__}: {type(exc).__name__}: {exc}")

    def post(self, kind: str, path: str, body: dict, **kw) -> requests.Response:
        r = requests.post(self.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)
        self.record(kind, r.status_code, r.text if r.status_code >= 400 else "")
        return r

    def generate(self, rnd, n):
        self.post("generate", "/api/generate", {"model": "soak", "prompt": f"Tell me about {rnd.random()}",
                                                "stream": False, "options": GREEDY})

    def chat_stream(self, rnd, n):
        with requests.post(self.url + "/api/chat", stream=True, timeout=120, json={
                "model": "soak", "options": GREEDY, "messages": [{"role": "user", "content": f"Hi {n}"}]}) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
            bad = [line for line in lines if "error" in line]
            self.record("chat-stream", 500 if bad else r.status_code, json.dumps(bad))

    def cut_stream(self, rnd, n):
        with requests.post(self.url + "/api/generate", stream=True, timeout=120, json={
                "model": "soak", "prompt": "A long story", "options": {"num_predict": 64}}) as r:
            self.record("cut-stream", r.status_code)
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    break  # the client leaves mid-answer

    def embed(self, rnd, n):
        self.post("embed", "/api/embed", {"model": "soak", "input": ["one", f"two {n}"]})

    def unload(self, rnd, n):
        self.post("keep_alive-0", "/api/generate", {"model": "soak", "prompt": "bye", "stream": False,
                                                     "keep_alive": 0, "options": GREEDY})

    def pull_delete(self, rnd, n):
        name = f"pulled{rnd.randrange(3)}"
        self.registry.cut[self.digests[name]] = 1  # its download cut half-way once: resumed by a Range request
        r = self.post("pull", "/api/pull", {"model": name, "stream": rnd.random() < 0.5})
        if r.status_code == 200:
            requests.delete(self.url + "/api/delete", json={"model": name}, timeout=60)

    def abandoned_pull(self, rnd, n):
        """A pull of the slow model that the client gives up after a second (a streamed one sends progress
        all the while, so no read times out: the client closes it)."""
        stream = rnd.random() < 0.5
        try:
            with requests.post(self.url + "/api/pull", json={"model": "slow", "stream": stream}, timeout=1,
                               stream=stream) as r:
                given_up = time.monotonic() + 1
                for _ in r.iter_lines():
                    if time.monotonic() > given_up:
                        break
        except requests.RequestException:
            pass

    def create_copy_delete(self, rnd, n):
        name = f"made{n}"
        r = self.post("create", "/api/create", {"model": name, "from": "pulled-base", "system": f"You are {n}.",
                                                "stream": False})
        if r.status_code == 200:
            self.post("copy", "/api/copy", {"source": name, "destination": f"{name}-copy"})
            for gone in (name, f"{name}-copy"):
                r = requests.delete(self.url + "/api/delete", json={"model": gone}, timeout=60)
                self.record("delete", r.status_code, r.text)

    def listing(self, rnd, n):
        for path in ("/api/tags", "/api/ps"):
            r = requests.get(self.url + path, timeout=30)
            self.record(path, r.status_code, r.text)
        self.post("show", "/api/show", {"model": "soak"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "tests"))  # the loopback registry the pull tests use
    from registry import serving_registry  # noqa: PLC0415

    from pyplugin.model.synth import write_gguf

    with tempfile.TemporaryDirectory() as tmp, serving_registry() as registry:
        tmp = Path(tmp)
        pulled: dict[str, str] = {}
        (tmp / "models").mkdir()
        write_gguf(tmp / "models" / "soak.gguf", **MODEL)
        for i, name in enumerate(["pulled0", "pulled1", "pulled2", "pulled-base", "slow"]):
            path = tmp / f"{name}.gguf"
            write_gguf(path, **{**MODEL, "seed": 100 + i})
            digest = registry.add("library", name, "latest", {"model": path.read_bytes()})["model"]
            pulled[name] = digest
            if name == "slow":
                registry.drip[digest] = 0.5
        server, url = start_server(str(tmp / "models"), {"OLLAMA_MODELS": str(tmp / "store"),
                                                         "PEBBLING_REGISTRY": registry.url})
        try:
            r = requests.post(url + "/api/pull", json={"model": "pulled-base", "stream": False}, timeout=120)
            assert r.status_code == 200, r.text
            soak = Soak(url, registry, args.seed, pulled)
            threads = [threading.Thread(target=soak.client, args=(n,), daemon=True) for n in range(args.clients)]
            started = time.monotonic()
            for t in threads:
                t.start()
            samples, first_minute = [], None
            while (elapsed := time.monotonic() - started) < args.minutes * 60:
                time.sleep(min(10.0, args.minutes * 60 - elapsed))
                sample = {"s": round(time.monotonic() - started), **proc_figures(server.pid)}
                samples.append(sample)
                if first_minute is None and sample["s"] >= 60:
                    first_minute = sample
                print(f"{sample['s']:5d} s  rss {sample['rss'] / 2**20:7.1f} MiB  threads {sample['threads']:3d}  "
                      f"fds {sample['fds']:3d}  requests {sum(soak.statuses.values())}", flush=True)
            soak.stop.set()
            for t in threads:
                t.join(timeout=180)
            time.sleep(15)  # idle: abandoned pulls end, worker threads retire
            end = proc_figures(server.pid)
            still = requests.post(url + "/api/generate", json={"model": "soak", "prompt": "Still there?",
                                                               "stream": False, "options": GREEDY}, timeout=120)
        finally:
            server.terminate()
            server.wait(timeout=30)
    first_minute = first_minute or samples[0]
    held = {"no unexpected 5xx": not soak.unexpected,
            "rss within 64 MiB of the first minute's": end["rss"] - first_minute["rss"] <= RSS_SLACK,
            "no thread growth": end["threads"] <= first_minute["threads"],
            "no open-file growth": end["fds"] <= first_minute["fds"],
            "serving after": still.status_code == 200}
    from .speed_cpu import cpu_model

    figures = {"machine": f"{cpu_model()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
               "minutes": args.minutes, "clients": args.clients, "requests": sum(soak.statuses.values()),
               "statuses": dict(sorted(soak.statuses.items())), "unexpected": soak.unexpected[:20],
               "refused": soak.refused,
               "first_minute": first_minute, "end_idle": end,
               "rss_growth_mib": round((end["rss"] - first_minute["rss"]) / 2**20, 1),
               "samples": samples, "held": held}
    print(json.dumps({k: v for k, v in figures.items() if k != "samples"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0 if all(held.values()) else 1


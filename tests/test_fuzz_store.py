"""Model management at a live server, against a hostile registry and over a store with links in it.

A seeded random sequence of operations: pulls of models whose blobs misbehave in every way tests/registry.py
knows (overlong, short, endless, dripping, stalling, cut, corrupt, named twice, redirected, a size that is
no size, a blob the registry lacks), streamed and not, some in bursts of concurrent pulls of one model, some
by clients that leave; copies, deletes and creates to and from names under a link out of the store and
names whose manifest is a link out; blob uploads with right and wrong digests, of a blob that is a link,
and uploads whose client leaves half-way; /api/show and /api/tags; and the links put back now and then, as
a user may change the store under the server. Meanwhile a watcher asks /api/tags every WATCH_EVERY_S.

Each answer must be one its request expects (EXPECTED: the only 5xx are a misbehaving registry's 502 and a
stalled pull's 504 at its deadline), every status one the OpenAPI document lists for its route, /api/tags
always answered within TAGS_WITHIN_S, no file outside the store changed (bytes, mtime) and none added, every
blob in the store its digest's bytes at the end (and nothing else there but resumable .pebbling-partial
downloads), and the server still generating. `make fuzz` runs PEBBLING_FUZZ_EXAMPLES=10000 / EXAMPLES_PER_OP
operations and prints the figures (PEBBLING_FUZZ_VERBOSE=1: how each kind of request ended); `make test`
150.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests

from helpers import pebbling_serve, tiny_path
from pyplugin.serving.pull import RETRIES
from registry import serving_registry

EXAMPLES = int(os.environ.get("PEBBLING_FUZZ_EXAMPLES", "300"))
EXAMPLES_PER_OP = 2        # an operation here is a request or several, some of them seconds long
SEED = 44
WORKERS = 6                # operations in flight at once
DEADLINE_S = 8             # PEBBLING_PULL_DEADLINE: a pull of a dripping or stalled blob ends at it
LEAVE_AFTER_S = (0.2, 1.5)  # a client that leaves waits this long first
WATCH_EVERY_S = 0.2
TAGS_WITHIN_S = 1.0
CLIENT_TIMEOUT_S = 120     # past any pull's deadline: a request unanswered by then hangs


def gguf(seed: int) -> bytes:
    return tiny_path("llama", seed=seed).read_bytes()


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


STREAM_ERROR = "200 ending in an error line"  # a streamed pull's error after its stream began


@dataclass(frozen=True)
class Expect:
    """An answer a request may get: its status (or STREAM_ERROR), and a piece of its error's text."""
    status: int | str
    says: str = ""


PULLED = (Expect(200), Expect(400, "is not in the store"))  # or a concurrent delete took a blob it names
# Every model the registry offers, by how its pull must end. The 5xx: 502 when the registry sends what a
# registry must not (after RETRIES retries of a body too long, too short or endless), 504 at the deadline.
EXPECTED: dict[str, tuple[Expect, ...]] = {
    "good": PULLED, "pieces": PULLED, "twice": PULLED, "moved": PULLED, "cut": PULLED,
    "overlong": (Expect(502, "more than the"),), "endless": (Expect(502, "more than the"),),
    "short": (Expect(502, "broke off at"),), "corrupt": (Expect(502, "is corrupt"),),
    "size-true": (Expect(502, "no size"),), "size-zero": (Expect(502, "the 0 bytes received"),),
    "lost-blob": (Expect(404, "has no blob"),), "absent": (Expect(404, "no such model"),),
    "drip": (Expect(504, "deadline"),), "stall": (Expect(504, "deadline"),),
    "outside/m": (Expect(400, "link"),),  # its manifest would go through the link out of the store
    "linked-manifest": PULLED,  # the link replaced, never written through
    "linked-blob": PULLED,      # its blob is there (a link): nothing to fetch
    "linked-partial": PULLED,   # its partial download is a link out: never written through
    **{f"linked-manifest-{i}": PULLED for i in range(3)},
}
SLOW = ("pieces", "drip", "stall", "endless", "good")  # what a leaving client pulls
COPIES = tuple(f"copy-{i}" for i in range(4))
LINKED_MANIFESTS = tuple(name for name in EXPECTED if name.startswith("linked-manifest-"))
SOURCES = ("good", "pieces", "twice", "cut", "linked-manifest", "linked-blob", *COPIES, *LINKED_MANIFESTS,
           "outside/m", "absent")
DESTINATIONS = (*COPIES, *LINKED_MANIFESTS, "outside/m", "outside/new", "twice")
UPLOADS = tuple(range(70, 73))  # seeds of GGUFs uploaded as blobs


# ---------------------------------------------------------------------------------------------------
# the registry and the store


def offer(registry) -> dict[str, str]:
    """The registry's models (EXPECTED's names), each its own GGUF; returns {name: its model blob's digest}."""
    digests = {}
    for seed, name in enumerate(EXPECTED):
        if name == "absent":
            continue
        namespace, model = name.split("/") if "/" in name else ("library", name)
        digests[name] = registry.add(namespace, model, "latest", {"model": gguf(50 + seed)})["model"]
    registry.pieces[digests["pieces"]] = (8, 0.05)
    registry.cut[digests["cut"]] = RETRIES  # set once: a pull meeting every cut still gets the blob
    registry.extra[digests["overlong"]] = b"!" * 100
    registry.endless.add(digests["endless"])
    registry.short[digests["short"]] = 1000
    registry.corrupt.add(digests["corrupt"])
    registry.drip[digests["drip"]] = 0.5
    registry.stall.add(digests["stall"])  # its headers, then nothing until the registry stops
    registry.redirect.add(digests["moved"])
    for name, change in (("twice", lambda m: m["layers"].append(dict(m["layers"][0]))),
                         ("size-true", lambda m: m["layers"][0].update(size=True)),
                         ("size-zero", lambda m: m["layers"][0].update(size=0)),
                         ("lost-blob", lambda m: m["layers"][0].update(digest=digest_of(b"no such blob")))):
        manifest = json.loads(registry.manifests[("library", name, "latest")])
        change(manifest)
        registry.add_manifest("library", name, "latest", manifest)
    registry.add("library", "anchor", "latest", {"model": gguf(2)})  # pulled first, never deleted: generated from
    return digests


def lay_links(store: Path, outside: Path, registry, digests: dict[str, str]) -> None:
    """The files outside the store, and the links to them: a namespace directory, manifest files, a blob and
    a partial download."""
    (outside / "namespace" / "m").mkdir(parents=True)
    (outside / "namespace" / "m" / "latest").write_bytes(registry.manifests[("library", "good", "latest")])
    for name in ("linked-manifest", *LINKED_MANIFESTS):
        (outside / f"{name}.json").write_bytes(registry.manifests[("library", "good", "latest")])
    (outside / "blob.gguf").write_bytes(registry.blobs[digests["linked-blob"]])
    (outside / "partial.bin").write_bytes(b"not the blob's bytes" * 50)
    (outside / "bystander.txt").write_text("a file beside the links, never to change\n")
    hosted = store / "manifests" / "registry.ollama.ai"
    hosted.mkdir(parents=True)
    (hosted / "outside").symlink_to(outside / "namespace", target_is_directory=True)
    (store / "blobs").mkdir()
    relink(store, outside, digests)


def relink(store: Path, outside: Path, digests: dict[str, str]) -> None:
    """Puts back the links that pulls, copies, deletes and uploads replaced or removed (as a user, or Ollama,
    may change the store under the server): each manifest and the blob replaced by its link at once, the
    partial download's link made where there is none."""
    def replace(path: Path, target: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            link = path.with_name(f".{path.name}.relink-{random.getrandbits(32):08x}")
            link.symlink_to(target)
            os.replace(link, path)
        except FileNotFoundError:
            pass  # its directory removed meanwhile by a delete: next time

    for name in ("linked-manifest", *LINKED_MANIFESTS):
        replace(store / "manifests" / "registry.ollama.ai" / "library" / name / "latest", outside / f"{name}.json")
    replace(store / "blobs" / digests["linked-blob"].replace(":", "-"), outside / "blob.gguf")
    try:
        (store / "blobs" / (digests["linked-partial"].replace(":", "-") + ".pebbling-partial")).symlink_to(
            outside / "partial.bin")
    except FileExistsError:
        pass  # a download holds it


def snapshot(place: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `place`: its bytes and mtime."""
    return {p.relative_to(place).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(place.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------
# the requests


class Run:
    """The answers seen, and what was wrong with them."""

    def __init__(self, url: str, documented: dict):
        self.url, self.documented = url, documented
        self.statuses: Counter = Counter()   # (route, status): the route as the OpenAPI document names it
        self.outcomes: Counter = Counter()   # (what was asked, how it ended)
        self.left = 0                        # requests whose client left on purpose
        self.slowest_admin = 0.0
        self.problems: list[str] = []
        self.hung = threading.Event()        # a request went unanswered: the operations left are not sent
        self.lock = threading.Lock()

    def record(self, method: str, route: str, r: requests.Response | None, expected: tuple[Expect, ...] | None,
               asked: str, took: float) -> None:
        """Checks an answer: its status documented, one of `expected` (any status below 500 when None) by
        its status or, streamed, by its last line. Any pull may end at its deadline, once it has taken that
        long (waiting for a model-management thread that pulls of stalled blobs hold counts)."""
        if route == "/api/pull" and expected is not None and took >= DEADLINE_S:
            expected = expected + streamed((Expect(504, "deadline"),))
        with self.lock:
            self.slowest_admin = max(self.slowest_admin, took)
            if r is None:
                self.left += 1
                self.outcomes[(asked, "left")] += 1
                return
            self.statuses[(route, r.status_code)] += 1
            documented = self.documented.get(route, {}).get(method, set())
            if str(r.status_code) not in documented:
                self.problems.append(f"{method} {route} ({asked}): {r.status_code} is not documented "
                                     f"({sorted(documented)}): {r.text[:200]}")
            status, says = outcome(r)
            self.outcomes[(asked, status)] += 1
            if expected is None:
                ok = isinstance(status, int) and status < 500
            else:
                ok = any(status == e.status and e.says in says for e in expected)
            if not ok:
                self.problems.append(f"{method} {route} ({asked}): {status} {says[:300]!r}, expected "
                                     f"{expected or 'no 5xx'}")


def outcome(r: requests.Response) -> tuple[int | str, str]:
    """The status a request ended with, and its error's text; a streamed 200 by its last line."""
    text = r.text
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/x-ndjson"):
        last = json.loads(text.strip().splitlines()[-1])
        if "error" in last:
            return STREAM_ERROR, last["error"]
        return (200, "") if last.get("status") == "success" else ("200 ending unfinished", json.dumps(last))
    try:
        body = r.json() if text else {}
    except ValueError:
        return r.status_code, f"not JSON: {text[:100]}"
    return r.status_code, body.get("error", "") if isinstance(body, dict) else ""


class Client:
    def __init__(self, run: Run):
        self.run, self.url = run, run.url

    def call(self, method: str, path: str, route: str, asked: str, expected: tuple[Expect, ...] | None = None,
             leave_after: float | None = None, **kwargs) -> requests.Response | None:
        started = time.monotonic()
        try:
            r = requests.request(method, self.url + path, timeout=leave_after or CLIENT_TIMEOUT_S, **kwargs)
        except requests.Timeout:
            if leave_after is None:
                with self.run.lock:
                    self.run.problems.append(f"{method} {path} ({asked}): no answer in {CLIENT_TIMEOUT_S} s")
                self.run.hung.set()
                return None
            r = None  # left, as meant
        self.run.record(method, route, r, expected, asked, time.monotonic() - started)
        return r

    def pull(self, name: str, stream: bool, leave_after: float | None = None) -> None:
        expected = streamed(EXPECTED[name]) if stream else EXPECTED[name]
        if leave_after is not None and stream:  # reads a line or two, then goes
            started = time.monotonic()
            try:
                with requests.post(f"{self.url}/api/pull", json={"model": name, "stream": True},
                                   stream=True, timeout=leave_after) as r:
                    for _ in zip(range(2), r.iter_lines()):
                        pass
            except requests.RequestException:
                pass
            self.run.record("POST", "/api/pull", None, None, f"pull {name}", time.monotonic() - started)
            return
        self.call("POST", "/api/pull", "/api/pull", f"pull {name}{' streamed' if stream else ''}", expected,
                  leave_after, json={"model": name, "stream": stream})

    def upload(self, data: bytes, digest: str, expected: tuple[Expect, ...], asked: str) -> None:
        self.call("POST", f"/api/blobs/{digest}", "/api/blobs/{digest}", asked, expected, data=data)

    def upload_and_leave(self, data: bytes) -> None:
        """Sends half of a blob, then closes the connection."""
        parsed = urlparse(self.url)
        head = (f"POST /api/blobs/{digest_of(data)} HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
                f"Content-Length: {len(data)}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
            sock.sendall(head + data[:len(data) // 2])
        self.run.record("POST", "/api/blobs/{digest}", None, None, "upload, half of it", 0.0)


def streamed(expected: tuple[Expect, ...]) -> tuple[Expect, ...]:
    """What a streamed pull may end with: the status itself (an error found before the stream began), or
    an error line saying the same."""
    return expected + tuple(Expect(STREAM_ERROR, e.says) for e in expected if e.status != 200)


def operations(rng: random.Random, count: int, uploads: dict[int, bytes]) -> list:
    """`count` operations: each kind of pull once, then drawn at random."""
    kinds = [("pull", name, rng.random() < 0.5) for name in EXPECTED]
    weighted = (["pull"] * 30 + ["burst"] * 10 + ["leave"] * 10 + ["copy"] * 10 + ["delete"] * 10 +
                ["create"] * 8 + ["create-files"] * 6 + ["upload"] * 8 + ["show"] * 5 + ["tags"] * 3 +
                ["relink"] * 3)
    while len(kinds) < count:
        op = rng.choice(weighted)
        if op == "pull":
            kinds.append(("pull", rng.choice(list(EXPECTED)), rng.random() < 0.5))
        elif op == "burst":
            kinds.append(("burst", rng.choice(list(EXPECTED)), rng.randint(2, 4)))
        elif op == "leave":
            kinds.append(("leave", rng.choice(SLOW), rng.random() < 0.5, rng.uniform(*LEAVE_AFTER_S)))
        elif op == "copy":
            kinds.append(("copy", rng.choice(SOURCES), rng.choice(DESTINATIONS)))
        elif op == "delete":
            kinds.append(("delete", rng.choice(DESTINATIONS + ("good", "pieces", "cut", "linked-blob",
                                                               "linked-manifest", "absent"))))
        elif op == "create":
            kinds.append(("create", rng.choice(SOURCES), rng.choice(DESTINATIONS)))
        elif op == "create-files":
            kinds.append(("create-files", rng.choice(list(uploads)), rng.choice(DESTINATIONS)))
        elif op == "upload":
            kinds.append(("upload", rng.choice(list(uploads)), rng.choice(["right", "wrong", "invalid", "linked",
                                                                           "leave"])))
        elif op == "relink":
            kinds.append(("relink",))
        else:
            kinds.append((op, rng.choice(SOURCES)))
    return kinds


def perform(client: Client, op: tuple, uploads: dict[int, bytes], world: tuple) -> None:
    registry, digests, store, outside, _ = world
    kind = op[0]
    if client.run.hung.is_set():
        return
    if kind == "relink":
        relink(store, outside, digests)
    elif kind == "pull":
        client.pull(op[1], op[2])
    elif kind == "burst":  # concurrent pulls of one model, streamed and not
        with ThreadPoolExecutor(op[2]) as pool:
            list(pool.map(lambda i: client.pull(op[1], i % 2 == 0), range(op[2])))
    elif kind == "leave":
        client.pull(op[1], op[2], leave_after=op[3])
    elif kind in ("copy", "create"):
        source, destination = op[1], op[2]
        if destination.startswith("outside/"):  # unless the source is found missing first
            expected = (Expect(400, "link"), Expect(404, "not found"))
        elif source == "absent":
            expected = (Expect(404, "not found"),)
        else:
            expected = None
        if kind == "copy":
            client.call("POST", "/api/copy", "/api/copy", f"copy {source} {destination}", expected,
                        json={"source": source, "destination": destination})
        else:
            client.call("POST", "/api/create", "/api/create", f"create {destination} from {source}", expected,
                        json={"model": destination, "from": source, "stream": False, "system": "Be brief."})
    elif kind == "delete":
        expected = ((Expect(400, "link"),) if op[1].startswith("outside/") else
                    (Expect(404, "not found"),) if op[1] == "absent" else (Expect(200), Expect(404, "not found")))
        client.call("DELETE", "/api/delete", "/api/delete", f"delete {op[1]}", expected, json={"model": op[1]})
    elif kind == "create-files":
        data = uploads[op[1]]
        client.upload(data, digest_of(data), (Expect(201),), "upload")
        expected = ((Expect(400, "link"),) if op[2].startswith("outside/") else
                    (Expect(200), Expect(400, "is not on the server"), Expect(400, "is not in the store")))
        client.call("POST", "/api/create", "/api/create", f"create {op[2]} from an upload", expected,
                    json={"model": op[2], "files": {"m.gguf": digest_of(data)}, "stream": False})
    elif kind == "upload":
        data, how = uploads[op[1]], op[2]
        if how == "right":
            client.upload(data, digest_of(data), (Expect(201),), "upload")
        elif how == "wrong":
            client.upload(data, digest_of(data + b"!"), (Expect(400, "hash to"),), "upload, wrong digest")
        elif how == "invalid":
            client.upload(data, "sha256:" + "g" * 64, (Expect(400, "invalid digest"),), "upload, invalid digest")
        elif how == "linked":  # the blob a link names: the link replaced, the file it named untouched
            client.upload(registry.blobs[digests["linked-blob"]], digests["linked-blob"], (Expect(201),),
                          "upload of a linked blob")
        else:
            client.upload_and_leave(data)
    elif kind == "show":
        client.call("POST", "/api/show", "/api/show", f"show {op[1]}", None, json={"model": op[1]})
    else:
        client.call("GET", "/api/tags", "/api/tags", "tags", (Expect(200),))


class Watcher(threading.Thread):
    """Asks /api/tags every WATCH_EVERY_S; keeps the slowest answer."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.slowest, self.asked, self.failures = url, threading.Event(), 0.0, 0, []

    def run(self) -> None:
        while not self.stop.wait(WATCH_EVERY_S):
            started = time.monotonic()
            try:
                r = requests.get(f"{self.url}/api/tags", timeout=30)
                if r.status_code != 200:
                    self.failures.append(f"/api/tags answered {r.status_code}: {r.text[:200]}")
            except requests.RequestException as exc:
                self.failures.append(f"/api/tags: {exc}")
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.asked += 1


# ---------------------------------------------------------------------------------------------------


BLOB_NAME = re.compile(r"sha256-([0-9a-f]{64})")


def settled_blobs(store: Path, within: float) -> tuple[dict[str, bool], list[str]]:
    """The store's blobs ({name: whether its bytes hash to its name}) and the files it should not hold:
    in blobs/ any but a blob or a resumable .pebbling-partial, in manifests/ a temporary one (a dot-file);
    taken once there are none (an upload or a create may still be writing) or `within` seconds passed."""
    deadline = time.monotonic() + within
    while True:
        names = sorted(p.name for p in (store / "blobs").iterdir())
        others = [n for n in names if not BLOB_NAME.fullmatch(n) and not n.endswith(".pebbling-partial")]
        others += [p.relative_to(store).as_posix() for p in (store / "manifests").rglob(".*")]
        if not others or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    blobs = {}
    for name in names:
        if m := BLOB_NAME.fullmatch(name):
            try:
                blobs[name] = hashlib.sha256((store / "blobs" / name).read_bytes()).hexdigest() == m.group(1)
            except FileNotFoundError:
                continue  # deleted since it was listed
    return blobs, others


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The registry, the store with its links laid, the place outside they lead to, and the server."""
    store, outside = tmp_path_factory.mktemp("ollama"), tmp_path_factory.mktemp("outside")
    with serving_registry() as registry:
        digests = offer(registry)
        lay_links(store, outside, registry, digests)
        env = {"OLLAMA_MODELS": str(store), "PEBBLING_REGISTRY": registry.url,
               "PEBBLING_PULL_DEADLINE": str(DEADLINE_S)}
        with pebbling_serve(tmp_path_factory.mktemp("models"), env) as served:
            yield registry, digests, store, outside, served


def test_model_management_against_a_hostile_registry_and_a_linked_store(world):
    registry, digests, store, outside, (url, documented, _) = world
    before, listed = snapshot(outside), sorted(outside.rglob("*"))
    r = requests.post(f"{url}/api/pull", json={"model": "anchor", "stream": False}, timeout=60)
    assert r.status_code == 200, r.text
    uploads = {seed: gguf(seed) for seed in UPLOADS}
    run = Run(url, documented)
    client = Client(run)
    ops = operations(random.Random(SEED), max(len(EXPECTED) + 8, EXAMPLES // EXAMPLES_PER_OP), uploads)
    watcher = Watcher(url)
    watcher.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            for done in [pool.submit(perform, client, op, uploads, world) for op in ops]:
                done.result()
    finally:
        watcher.stop.set()
        watcher.join()
    took = time.monotonic() - started

    # Pulls whose clients left stop at their next bytes, or at their deadline: then the store is still.
    blobs, others = settled_blobs(store, DEADLINE_S + 5)
    after = snapshot(outside)
    r = requests.post(f"{url}/api/generate", json={"model": "anchor", "prompt": "Hello", "stream": False,
                                                   "options": {"temperature": 0, "num_predict": 2}}, timeout=60)
    statuses: Counter = Counter()
    for (_, status), n in run.statuses.items():
        statuses[status] += n
    fives = {f"{route} {status}": n for (route, status), n in sorted(run.statuses.items()) if status >= 500}
    print(f"\nfuzz store: {len(ops)} operations, {sum(statuses.values()) + run.left} requests in {took:.1f} s "
          f"({run.left} more left by their client); statuses {dict(sorted(statuses.items()))}; 5xx {fives} (a "
          f"misbehaving registry's 502, a stalled pull's 504, each where expected); slowest /api/tags "
          f"{watcher.slowest * 1000:.0f} ms of {watcher.asked} asked; slowest model-management answer "
          f"{run.slowest_admin:.1f} s; {len(blobs)} blobs in the store, {sum(not ok for ok in blobs.values())} "
          f"not their digest's bytes; outside files {len(before)}, changed "
          f"{sum(before.get(k) != after.get(k) for k in before.keys() | after.keys())}; problems {len(run.problems)}")
    if os.environ.get("PEBBLING_FUZZ_VERBOSE"):
        for (asked, status), n in sorted(run.outcomes.items(), key=str):
            print(f"  {asked}: {status} x{n}")
    assert not run.problems, "\n".join(run.problems[:20])
    # A pull ends at its deadline; one may first wait that long for a thread held by a pull stalled as long.
    assert run.slowest_admin < 2 * DEADLINE_S + 5, f"a model-management request took {run.slowest_admin:.1f} s"
    assert not watcher.failures, watcher.failures[:5]
    assert watcher.slowest < TAGS_WITHIN_S, f"/api/tags took {watcher.slowest:.2f} s"
    assert after == before, {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert sorted(outside.rglob("*")) == listed
    assert all(blobs.values()), [name for name, ok in blobs.items() if not ok]
    assert not others, others
    assert r.status_code == 200 and r.json()["eval_count"] == 2, r.text

"""`ollama pull` over Ollama's registry protocol (the OCI distribution API), into Ollama's store.

    GET {base}/v2/{namespace}/{model}/manifests/{tag}     the manifest: a config and layers, by digest
    GET {base}/v2/{namespace}/{model}/blobs/{digest}      each blob (a redirect to a CDN is followed)

{base} is $PEBBLING_REGISTRY for names of Ollama's registry (default https://registry.ollama.ai), and
https://HOST (http:// with insecure) for a name that carries its own host (a redirect to another host,
such as a CDN, is followed and logged). Each blob is downloaded to blobs/sha256-<hex>.pebbling-partial,
held by one pull at a time (another pull of the same blob waits for it, then finds it written); a
download that breaks off is retried from where it stopped (an HTTP Range request) and, failing that,
resumed by the next pull. Nothing is written past the size the manifest gives: a body that is longer, or
shorter, is a failed attempt, and RETRIES of them end the pull. Every blob is verified against its digest
before it is named: a blob whose bytes do not match is removed and the pull refused, saying so. The
manifest is written last, so a model is listed only once all of it is there. A pull ends when its
`cancel` event is set (its client left) and at its deadline ($PEBBLING_PULL_DEADLINE seconds, default a
day), keeping what it fetched for the next pull; a read that a stalled registry keeps waiting ends then
too (its connection is shut under it), not at the registry's timeout. Progress comes as Ollama's objects:
"pulling manifest", "pulling <digest>" with total and completed, "verifying sha256 digest", "writing
manifest", "success".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

from ..errors import PebblingError
from .ollama_store import DEFAULT_HOST, MODEL_MEDIA_TYPE, OllamaName, parse_name
from .store_write import (BlobBusy, BlobsMissing, BlobWriter, DigestMismatch, RegistryError, RegistryNotFound,
                          StoreError, blob_path, digest_hex, write_manifest_bytes)

REGISTRY_ENV = "PEBBLING_REGISTRY"
DEADLINE_ENV = "PEBBLING_PULL_DEADLINE"
DEFAULT_REGISTRY = "https://registry.ollama.ai"
DEFAULT_DEADLINE_S = 24 * 3600.0
MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
MAX_MANIFEST_BYTES = 1 << 20
RETRIES = 3              # a failed attempt (broken off, too long, too short) is retried this many times
PROGRESS_EVERY_S = 0.1   # at most this often a progress object per blob (and at its end)
WAIT_POLL_S = 0.2        # how often a pull waiting for another's download of a blob looks again
STOP_POLL_S = 0.2        # how often the pulls reading from the registry are asked whether they must stop

logger = logging.getLogger("pebbling.server")


class PullStopped(PebblingError):
    """The pull was stopped: its client left, or its deadline passed. What it fetched is kept."""


def registry_base(name: OllamaName, insecure: bool = False) -> str:
    if name.host == DEFAULT_HOST:
        return (os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).rstrip("/")
    return f"{'http' if insecure else 'https'}://{name.host}"


def pull_deadline() -> float:
    """Seconds a pull may take in all: $PEBBLING_PULL_DEADLINE, else a day."""
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_DEADLINE_S
    except ValueError:
        value = -1.0
    if not value > 0:
        logger.warning("%s=%r is not a positive number of seconds; using %g", DEADLINE_ENV, raw, DEFAULT_DEADLINE_S)
        return DEFAULT_DEADLINE_S
    return value


def pull_model(name: str, root: Path | None = None, *, insecure: bool = False, timeout: float = 30.0,
               cancel: threading.Event | None = None, deadline_s: float | None = None) -> Iterator[dict[str, Any]]:
    """Checks the name (InvalidModelName) and returns the pull's progress; RegistryError (RegistryNotFound
    for a name the registry does not have), StoreError or PullStopped while it runs. `timeout`: the longest
    wait for the registry's next bytes, each time."""
    parsed = parse_name(name)
    stop = _Stop(cancel or threading.Event(), time.monotonic() + (deadline_s or pull_deadline()), parsed.display)
    return _pull(parsed, root, registry_base(parsed, insecure), timeout, stop)


class _Stop:
    """Whether the pull must stop: its client left (the event), or its deadline passed."""

    def __init__(self, event: threading.Event, deadline: float, display: str):
        self.event, self.deadline, self.display = event, deadline, display

    def due(self) -> bool:
        return self.event.is_set() or time.monotonic() > self.deadline

    def timeout(self, timeout: httpx.Timeout) -> httpx.Timeout:
        """The client's timeout, shortened to what is left before the deadline (a registry that never
        answers is given up on then)."""
        left = max(0.1, self.deadline - time.monotonic())
        return httpx.Timeout(min(timeout.read or left, left), connect=min(timeout.connect or left, left))

    def check(self) -> None:
        if self.event.is_set():
            raise PullStopped(f"pulling '{self.display}': stopped, its client left; what was fetched is kept for "
                              "the next pull")
        if time.monotonic() > self.deadline:
            raise PullStopped(f"pulling '{self.display}': stopped at its deadline (${DEADLINE_ENV}); what was "
                              "fetched is kept for the next pull")


class _Interrupter:
    """One thread that shuts the connection of each pull reading from the registry once the pull must stop
    (its client left, its deadline passed): a read that a stalled registry keeps waiting then ends at once,
    instead of holding a model-management thread until the registry's timeout."""

    def __init__(self):
        self._reading: dict[tuple[int, int], tuple[_Stop, socket.socket]] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self, response: httpx.Response, stop: _Stop) -> Iterator[None]:
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:  # a transport without a socket (a test's): nothing to shut
            yield
            return
        key = id(stop), id(response)
        with self._changed:
            self._reading[key] = (stop, sock)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pebbling-pull-stops", daemon=True)
                self._thread.start()
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                del self._reading[key]

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._reading)
                for stop, sock in self._reading.values():
                    if stop.due():
                        try:
                            sock.shutdown(socket.SHUT_RDWR)  # the read under way ends; the pull sees why
                        except OSError:
                            pass  # already closed
            time.sleep(STOP_POLL_S)


_interrupter = _Interrupter()


def _pull(name: OllamaName, root: Path | None, base: str, timeout: float, stop: _Stop) -> Iterator[dict[str, Any]]:
    yield {"status": "pulling manifest"}
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 15.0)), follow_redirects=True,
                      event_hooks={"response": [_log_redirects]}) as client:
        raw, layers = _manifest(client, base, name, stop)
        for attempt in range(RETRIES + 1):
            for layer in {layer["digest"]: layer for layer in layers}.values():  # a blob named twice: once
                yield from _download(client, base, name, layer, root, stop)
            yield {"status": "verifying sha256 digest"}  # each blob was, as it was committed
            yield {"status": "writing manifest"}
            try:
                write_manifest_bytes(name, raw, root)
                break
            except BlobsMissing:  # a delete of a model that shared a blob removed it meanwhile: fetch it again
                if attempt == RETRIES:
                    raise
    yield {"status": "success"}


def _log_redirects(response: httpx.Response) -> None:
    if response.is_redirect and "location" in response.headers:
        to = response.url.join(response.headers["location"])
        if to.host != response.url.host:
            logger.info("pull: %s redirected to another host, %s (followed, as Ollama follows it)",
                        response.url.host, to.host)


def _manifest(client: httpx.Client, base: str, name: OllamaName, stop: _Stop) -> tuple[bytes, list[dict[str, Any]]]:
    url = f"{base}/v2/{name.namespace}/{name.model}/manifests/{name.tag}"
    try:
        r = client.get(url, headers={"Accept": MANIFEST_ACCEPT}, timeout=stop.timeout(client.timeout))
    except httpx.HTTPError as exc:
        stop.check()  # the deadline, not the registry, ended the wait
        raise RegistryError(f"pulling '{name.display}': cannot reach the registry at {base} ({exc}); set "
                            f"${REGISTRY_ENV} to use another") from None
    if r.status_code == 404:
        raise RegistryNotFound(f"pulling '{name.display}': the registry at {base} has no such model or tag "
                               f"(manifest {name.namespace}/{name.model}:{name.tag} not found)")
    if r.status_code != 200:
        raise RegistryError(f"pulling '{name.display}': the registry at {base} answered the manifest request "
                            f"with HTTP {r.status_code}: {r.text[:200]}")
    raw = r.content
    try:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"it is over {MAX_MANIFEST_BYTES} bytes")
        data = json.loads(raw)
        layers = [*data["layers"], data["config"]] if data.get("config") else list(data["layers"])
        for layer in layers:
            digest_hex(layer["digest"])
            size = layer.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"layer {layer['digest']} has no size (a whole number of bytes), it has "
                                 f"{json.dumps(size)[:40]}")
    except (ValueError, KeyError, TypeError, AttributeError, StoreError) as exc:
        raise RegistryError(f"pulling '{name.display}': the registry's manifest is not one pebbling can read "
                            f"({exc})") from None
    if not any(layer.get("mediaType") == MODEL_MEDIA_TYPE for layer in layers):
        raise RegistryError(f"pulling '{name.display}': its manifest has no GGUF model layer ({MODEL_MEDIA_TYPE}); "
                            "pebbling serves GGUF models")
    return raw, layers


def _download(client: httpx.Client, base: str, name: OllamaName, layer: dict[str, Any], root: Path | None,
              stop: _Stop) -> Iterator[dict[str, Any]]:
    """Yields progress until the blob is in the store, verified."""
    digest, total = layer["digest"], layer["size"]
    status = {"status": f"pulling {digest_hex(digest)[:12]}", "digest": digest, "total": total}
    writer = None
    while writer is None:
        if blob_path(digest, root).is_file():
            yield {**status, "completed": total}
            return
        stop.check()
        try:
            writer = BlobWriter(digest, root, resume=True, size=total)
        except BlobBusy:  # another pull has it: wait for it, then find it written (or take it over)
            yield {**status, "completed": 0}
            time.sleep(WAIT_POLL_S)
    try:
        if blob_path(digest, root).is_file():  # written by the pull this one waited for
            writer.abort(keep=True)
            yield {**status, "completed": total}
            return
        yield from _fetch(client, f"{base}/v2/{name.namespace}/{name.model}/blobs/{digest}", name.display, writer,
                          status, stop)
    except BaseException:
        writer.abort(keep=True)
        raise


def _fetch(client: httpx.Client, url: str, display: str, writer: BlobWriter, status: dict[str, Any],
           stop: _Stop) -> Iterator[dict[str, Any]]:
    """Fetches the rest of the blob into `writer` and commits it. A failed attempt (the connection broken,
    a body longer or shorter than the blob) is retried from what was kept, RETRIES times."""
    digest, total = status["digest"], status["total"]
    failures, last, fetched = 0, 0.0, False

    def failed(why: str, restart: bool = False) -> None:
        nonlocal failures
        failures += 1
        if restart:
            writer.restart()
        if failures > RETRIES:
            raise RegistryError(f"pulling '{display}': the download of {digest} failed: {why}, and so did "
                                f"{RETRIES} retries; pull again to resume it")
        logger.info("pull of %s: %s; retrying (%d of %d)", digest, why, failures, RETRIES)

    while True:
        stop.check()
        yield {**status, "completed": writer.size}
        if writer.size == total:
            if writer.matches():
                writer.commit()
                return
            if fetched:
                try:
                    writer.commit()  # raises DigestMismatch, and removes the bytes
                except DigestMismatch as exc:
                    raise RegistryError(f"pulling '{display}': blob {digest} is corrupt: {exc}; pull again (a "
                                        "registry or proxy that keeps sending other bytes is at fault)") from None
            writer.restart()  # bytes an earlier pull left that are not the blob's: fetched again
        fetched = True
        try:
            headers = {"Range": f"bytes={writer.size}-"} if writer.size else {}
            with client.stream("GET", url, headers=headers, timeout=stop.timeout(client.timeout)) as r, \
                    _interrupter.watching(r, stop):
                if r.status_code == 200 and writer.size:
                    writer.restart()  # the server sends the whole blob, not the rest
                elif r.status_code == 416:
                    failed(f"the registry refused the range from byte {writer.size} (HTTP 416)", restart=True)
                    continue
                elif r.status_code == 404:
                    raise RegistryNotFound(f"pulling '{display}': the registry has no blob {digest}")
                elif r.status_code not in (200, 206):
                    raise RegistryError(f"pulling '{display}': blob {digest}: the registry answered HTTP "
                                        f"{r.status_code}")
                overlong = False
                for chunk in r.iter_bytes():  # as they come: a buffered chunk would be lost to a cut
                    stop.check()
                    room = total - writer.size
                    if len(chunk) > room:
                        writer.write(chunk[:room])
                        overlong = True
                        break
                    writer.write(chunk)
                    if time.monotonic() - last >= PROGRESS_EVERY_S:
                        last = time.monotonic()
                        yield {**status, "completed": writer.size}
            if overlong:
                failed(f"the registry sent more than the {total} bytes its manifest gives", restart=True)
            elif writer.size < total:
                failed(f"the response ended after {writer.size} of {total} bytes")
        except httpx.HTTPError as exc:
            stop.check()  # it broke off because the pull must stop: say that, not a registry's failure
            failed(f"broke off at {writer.size} of {total} bytes ({exc or type(exc).__name__})")

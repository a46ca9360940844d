"""pebbling on Ray Serve: N replicas, each its own engine behind the same HTTP API, and a front that
sends every request of a conversation to the replica holding its KV cache (pip install 'pebbling[ray]').

    front (the application's ingress, one replica): reads the body, finds the conversation's keys
      (affinity.py), names the replica that last answered them, and forwards the request by handle
    replicas (`PebblingReplica`, num_replicas of them): `serve.ingress` of the pebbling FastAPI app,
      built on the replica with its own Engine; `forward` runs one request through that app in-process
      and streams the response back
    `PreferredReplicaRouter`: Serve's request router for the replicas: the named replica while it is
      running and has room, else the least loaded one

`GET /api/ps` and `GET /metrics` at the front answer for every running replica (each model listed with
its `replica`, each sample labelled with it), or for the one an `X-Pebbling-Replica` header names.

A replica that dies: the requests it was answering end with an error line that says so (those it had
not started are routed again by Serve), its conversations go to the least loaded replica and are
prefilled there again, and Serve starts a replacement.

Built by `build_app(args)` from a dict of options (`serve run` config files pass theirs as `args`):
models, num_replicas, num_gpus and num_cpus per replica, max_queue, max_context, num_parallel,
parked_kv_mib, backend, options (defaults for every request's options), host, autoscaling (Serve's
autoscaling_config, in place of num_replicas): see ray_config.py. The engine knows nothing of Ray: this
module adapts it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import re
from typing import AsyncIterator

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .affinity import SESSION_HEADER, ConversationTable, conversation_keys
from .engine import Engine
from .ray_config import RayConfig
from .settings import HOST_ENV

logger = logging.getLogger("pebbling.ray")

# By name: pyplugin never imports the server (server_patch uses pyplugin); the replica builds it.
APP_FACTORY = "server_patch.app:create_app"
REPLICA_HEADER = "x-pebbling-replica"  # on every response: which replica answered
THREADS_ENV = "PEBBLING_THREADS"       # the host library's thread count (model/attention.py)
PREFER = "prefer"                      # the forward call's keyword naming the replica wanted
REPLICA_DEPLOYMENT = "pebbling"
MAX_BODY_BYTES = 8 << 20  # the app's own limit (server_patch.app), which the front cannot import
AGGREGATED = ("/api/ps", "/metrics")   # answered for every replica, or the one X-Pebbling-Replica names
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"}


# ---------------------------------------------------------------------------------------------------
# routing


class PreferredReplicaRouter(RequestRouter):
    """The replica a request names (PREFER) first, while it runs and has room; otherwise, and for requests
    that name none, the least loaded (Serve picks the lowest queue length within a rank)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        wanted = pending_request.kwargs.get(PREFER) if pending_request is not None else None
        if wanted:
            first = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
            if first:
                return [first, [r for r in candidate_replicas if r is not first[0]]]
        return [candidate_replicas]


# ---------------------------------------------------------------------------------------------------
# a replica: the engine behind the FastAPI app


@serve.deployment(name=REPLICA_DEPLOYMENT)
@serve.ingress()
class PebblingReplica:
    def __init__(self, settings: dict):
        self.settings = settings
        self.name = serve.get_replica_context().replica_id.unique_id
        self.engine: Engine | None = None

    def __serve_build_asgi_app__(self):
        s = self.settings
        if s.get("host"):
            os.environ[HOST_ENV] = s["host"]
        if s.get("threads") and not os.environ.get(THREADS_ENV):
            os.environ[THREADS_ENV] = str(s["threads"])
        parked = s.get("parked_kv_mib")
        self.engine = Engine(s.get("models"), backend=s.get("backend"), max_queue=s.get("max_queue"),
                             max_context=s.get("max_context"), num_parallel=s.get("num_parallel"),
                             parked_kv_bytes=None if parked is None else parked << 20)
        module, name = APP_FACTORY.split(":")
        self.http_app = getattr(importlib.import_module(module), name)(self.engine)
        return self.http_app

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                      client: tuple | None = None, prefer: str | None = None) -> AsyncIterator:
        """One HTTP request through the app: yields {"status", "headers", "replica"}, then the body's
        pieces. The caller going away (Serve cancels the generator) reads as the client disconnecting,
        so the engine stops the generation."""
        body = self._with_defaults(path, body)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": [(k, v) for k, v in headers if k.lower() != b"content-length"]
                 + [(b"content-length", str(len(body)).encode())],
                 "client": client, "server": ("127.0.0.1", 80)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        task = asyncio.ensure_future(self.http_app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "replica": self.name,
                           "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.name.encode())]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # the app's error handlers answer errors: this is past them
        finally:
            gone.set()  # the app's handler sees the client gone, cancels the job, and returns
            if not task.done():
                try:
                    await asyncio.wait_for(task, timeout=5)  # cancels it past that
                except Exception:
                    pass

    def _with_defaults(self, path: str, body: bytes) -> bytes:
        """The deployment's default options under the request's own (which win)."""
        defaults = self.settings.get("options")
        if not defaults or not path.startswith("/api/") or not body:
            return body
        try:
            request = json.loads(body)
        except ValueError:
            return body  # the app answers the bad JSON itself
        if not isinstance(request, dict) or "model" not in request or not isinstance(request.get("options") or {}, dict):
            return body
        request["options"] = {**defaults, **(request.get("options") or {})}
        return json.dumps(request).encode()

    def __del__(self):
        if self.engine is not None:
            self.engine.close()


# ---------------------------------------------------------------------------------------------------
# the front: conversation affinity


@serve.deployment(name="pebbling-front", ray_actor_options={"num_cpus": 0})
class PebblingFront:
    """A plain deployment taking Serve's HTTP requests (an application has one `serve.ingress`, the
    replicas')."""

    def __init__(self, replicas: DeploymentHandle):
        self.replicas = replicas.options(stream=True)
        self.table = ConversationTable()

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and _within(request) in AGGREGATED:
            return await self._aggregate(_within(request), request.headers.get(REPLICA_HEADER))
        body = bytearray()
        async for piece in request.stream():  # bounded as the app bounds it: the front buffers the body
            body += piece
            if len(body) > MAX_BODY_BYTES:
                return JSONResponse({"error": f"request body over {MAX_BODY_BYTES >> 20} MiB"}, status_code=413)
        body = bytes(body)
        path = _within(request)
        keys = conversation_keys(path, body, request.headers.get(SESSION_HEADER))
        prefer = self.table.owner(keys) if keys else None
        stream = self.replicas.forward.remote(request.method, path, request.scope.get("query_string", b""),
                                              request.scope["headers"], body,
                                              request.client and (request.client.host, request.client.port),
                                              prefer=prefer)
        try:
            head = await stream.__anext__()
        except Exception as exc:  # the replica died before it answered: nothing was sent yet
            logger.warning("no replica answered %s %s: %s", request.method, request.url.path, exc)
            return JSONResponse({"error": f"the pebbling replica chosen for this request stopped before "
                                          f"answering ({type(exc).__name__}); send it again"}, status_code=503)
        replica = head["replica"]
        if keys and head["status"] < 400:
            self.table.record(keys, replica)
        # An Ollama generate turn's answer carries the conversation's tokens (`context`), which its next
        # turn sends back: they are recorded as the conversation's keys when the answer ends.
        follow = _model_of(body) if path == "/api/generate" and head["status"] < 400 else None
        response = StreamingResponse(self._rest(stream, replica, dict(head["headers"]).get(b"content-type", b""),
                                                follow), status_code=head["status"])
        response.raw_headers = [(k, v) for k, v in head["headers"] if k.lower() not in HOP_BY_HOP]
        return response

    def _record_context(self, model: str, last: bytes, replica: str) -> None:
        try:
            context = json.loads(last.strip().rsplit(b"\n", 1)[-1]).get("context")
        except (ValueError, AttributeError):
            return
        if isinstance(context, list) and context:
            self.table.record(conversation_keys("/api/generate", json.dumps({"model": model, "context": context})
                                                .encode()), replica)

    async def _aggregate(self, path: str, wanted: str | None) -> Response:
        """/api/ps and /metrics of every running replica, or of the one an X-Pebbling-Replica header names:
        ps lists each replica's models with a `replica` field, metrics label every sample `replica`."""
        names = [wanted] if wanted else self._replica_names()
        found = {}
        for name in names:  # one at a time: calls made within one request share its id, by which Serve's
            try:            # router hands a chosen replica to the call waiting for it
                answered, body = await self._whole("GET", path, prefer=name)
            except Exception:  # gone since it was listed
                continue
            if answered == name:  # a replica that is gone or full is answered for by another: left out
                found[name] = body
        if wanted and not found:
            return JSONResponse({"error": f"no running replica {wanted!r}; running: "
                                          f"{', '.join(self._replica_names()) or 'none'}"}, status_code=404)
        if path == "/api/ps":
            return JSONResponse({"models": [{**m, "replica": name} for name, b in found.items()
                                            for m in json.loads(b)["models"]]})
        return Response(merge_metrics({name: b.decode() for name, b in found.items()}), media_type=METRICS_TYPE)

    async def _whole(self, method: str, path: str, prefer: str) -> tuple[str, bytes]:
        """(the replica that answered, the whole body) of a bodiless request."""
        stream = self.replicas.forward.remote(method, path, b"", [(b"host", b"127.0.0.1")], b"", None, prefer=prefer)
        head = await stream.__anext__()
        return head["replica"], b"".join([piece async for piece in stream])

    @staticmethod
    def _replica_names() -> list[str]:
        prefix = f"SERVE_REPLICA::{serve.get_replica_context().app_name}#{REPLICA_DEPLOYMENT}#"
        return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(prefix))

    async def _rest(self, stream, replica: str, content_type: bytes, follow: str | None = None):
        ended, last = False, b""
        try:
            async for piece in stream:
                last = piece
                yield piece
            ended = True
            if follow:
                self._record_context(follow, last, replica)
        except Exception as exc:  # the status line is sent: say what was lost in the body, as Ollama does
            self.table.forget(replica)
            error = {"error": f"pebbling replica {replica} stopped while answering ({type(exc).__name__}); "
                              "this response is incomplete: send the request again"}
            logger.warning("%s", error["error"])
            if content_type.startswith(b"text/event-stream"):
                yield f"data: {json.dumps(error)}\n\n".encode()
            else:
                yield (json.dumps(error) + "\n").encode()
            ended = True
        finally:
            if not ended:  # the client went away: the replica's generator is cancelled, so its engine stops
                stream.cancel()


def _model_of(body: bytes) -> str | None:
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None


def _within(request: Request) -> str:
    """The request's path below the application's route prefix (Serve's root_path), as the app routes it."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)")


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one: each family's HELP and TYPE once, then every replica's
    samples of it, labelled replica="NAME"."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                if line not in headers.setdefault(family, []):
                    headers[family].append(line)
                samples.setdefault(family, [])
            elif family is not None and (m := _SAMPLE.fullmatch(line)):
                name, labels, rest = m.groups()
                inner = f'replica="{replica}"' + ("," + labels[1:-1] if labels and labels != "{}" else "")
                samples[family].append(f"{name}{{{inner}}}{rest}")
    return "".join("\n".join(headers[f] + samples[f]) + "\n" for f in headers)


def build_app(args: dict | None = None) -> serve.Application:
    """The application: the front and its replicas (see RayConfig for the options in `args`)."""
    config = RayConfig.from_args(args)
    replicas = PebblingReplica.options(
        **config.scaling(), ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        request_router_config=RequestRouterConfig(request_router_class=PreferredReplicaRouter),
    ).bind(config.replica())
    return PebblingFront.options(max_ongoing_requests=config.max_queue * config.most_replicas()).bind(replicas)

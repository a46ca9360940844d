"""What the server has done, for Prometheus (`GET /metrics`) and for its log.

Counted per response as it ends: requests by route and status and their latency; prompt and generated
tokens, bytes restored from the host tier and the last measured (or byte-accounted) peak device memory
per model. Read at each scrape: the models loaded and the requests queued or running. Each generation
that ends also writes one log line with what it cost.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.responses import Response
from starlette.routing import Match

from pyplugin.serving import Engine, Final

logger = logging.getLogger("pebbling.server")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    """Figures read from the engine when Prometheus scrapes."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        running = self.engine.running()
        loaded = GaugeMetricFamily("pebbling_models_loaded", "Models loaded now")
        loaded.add_metric([], len(running))
        queued = GaugeMetricFamily("pebbling_requests_active", "Requests queued or running now")
        queued.add_metric([], sum(m.active for m in running))
        yield loaded
        yield queued


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.requests = Counter("pebbling_requests", "HTTP requests answered", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("pebbling_request_seconds", "Time to answer an HTTP request (to the last byte)",
                                 ["route"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.prompt_tokens = Counter("pebbling_prompt_tokens", "Prompt tokens evaluated", ["model"],
                                     registry=self.registry)
        self.generated_tokens = Counter("pebbling_generated_tokens", "Tokens generated", ["model"],
                                        registry=self.registry)
        self.bytes_restored = Counter("pebbling_bytes_restored", "Bytes restored from the host tier", ["model"],
                                      registry=self.registry)
        self.peak = Gauge("pebbling_peak_device_bytes", "Peak device memory of the model's last request (measured "
                          "on a GPU, byte-accounted on host and stub)", ["model"], registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    routes: list = []  # the app's routes, set when it is built: labels are their paths, never a client's

    def route_of(self, scope) -> str:
        for route in _flat(self.routes):
            if route.matches(scope)[0] == Match.FULL:
                return route.path
        return "unmatched"

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

    def finished(self, final: Final) -> None:
        """A generation or embedding ended: count it and log one line of what it cost."""
        model, report = final.model, final.report or {}
        self.prompt_tokens.labels(model).inc(final.prompt_eval_count)
        self.generated_tokens.labels(model).inc(final.eval_count)
        self.bytes_restored.labels(model).inc(report.get("bytes_restored") or 0)
        if report.get("measured_peak_bytes") is not None:
            self.peak.labels(model).set(report["measured_peak_bytes"])
        logger.info("model=%s done=%s strategy=%s backend=%s resident=%s/%s prompt_tokens=%d prompt_ms=%.1f "
                    "generated=%d generate_ms=%.1f total_ms=%.1f bytes_restored=%s peak_bytes=%s (%s)",
                    model, final.done_reason, report.get("strategy"), report.get("backend"),
                    report.get("resident_layers"), report.get("n_layers"), final.prompt_eval_count,
                    final.prompt_eval_duration / 1e6, final.eval_count, final.eval_duration / 1e6,
                    final.total_duration / 1e6, report.get("bytes_restored"), report.get("measured_peak_bytes"),
                    str(report.get("measured_peak_how", "")).split(" ", 1)[0])


def _flat(routes):
    """Routes with a path, out of the routers included into others."""
    for route in routes:
        if getattr(route, "path", None) is not None:
            yield route
        else:
            inner = getattr(getattr(route, "original_router", None), "routes", None) or getattr(route, "routes", [])
            yield from _flat(inner)


class RequestMetrics:
    """ASGI middleware: each HTTP response's status and time, by the route that answered it."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = self.metrics.route_of(scope)
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)

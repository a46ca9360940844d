"""The OpenAPI document as the server answers: FastAPI documents a 422 for every body it validates, but
pebbling answers bad requests with 400 (as Ollama does), refused origins with 403, unknown models with
404, oversized bodies with 413, a full queue or too many connections with 503 and a bug with a JSON 500;
model management adds its own (a registry's failure 502, a pull's deadline 504, a full disk 507, push
501); the streaming routes document their NDJSON or event-stream 200 beside the JSON one."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "description": "what was wrong and what would be accepted: a string on Ollama's routes, an object "
                       "with `message` on the /v1 routes (OpenAI's shape)",
        "oneOf": [{"type": "string"}, {"type": "object", "required": ["message"],
                                       "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}],
    }},
}
EVERY_ROUTE = {"403": "the request's Origin or Host is not allowed (see PEBBLING_ORIGINS, PEBBLING_HOST)",
               "500": "a bug; the message carries a request id the server log has the details under",
               "503": "the server is busy: too many requests queued (PEBBLING_MAX_QUEUE) or connections open "
                      "(PEBBLING_MAX_CONNECTIONS); try again later"}
WITH_A_NAME = {"400": "the name in the path is not a valid model name",  # GET /v1/models/{model}
               "404": "no model has that name"}
# Routes that stream: with "stream" (Ollama's default on its routes), the 200 is one JSON object per line,
# or OpenAI's server-sent events.
STREAMS = {"/api/generate": "application/x-ndjson", "/api/chat": "application/x-ndjson",
           "/api/create": "application/x-ndjson", "/api/pull": "application/x-ndjson",
           "/v1/chat/completions": "text/event-stream", "/v1/completions": "text/event-stream",
           "/v1/responses": "text/event-stream"}
WITH_A_BODY = {"400": "the request is invalid: JSON, a field, an option, a model name, a prompt longer than "
                      "num_ctx, a model that cannot be served; the message says which and what is accepted",
               "404": "no model has that name",
               "413": "the body is larger than the server takes",
               "503": "the server is busy: too many requests queued (PEBBLING_MAX_QUEUE); try again later"}

# Model management: what else the store and the registry answer.
FULL_DISK = {"507": "the disk refused the write (full, read-only, no permission): nothing partial is kept"}
OWN_CODES = {
    "/api/blobs/{digest}": {"400": "the digest is not sha256:<64 hex>, or the bytes sent do not hash to it (they "
                                   "are removed)", **FULL_DISK},
    "/api/pull": {"404": "the registry has no such model or tag",
                  "502": "the registry could not be reached, answered an error, or sent a blob whose bytes do not "
                         "match its digest (removed)",
                  "504": "the pull stopped at its deadline (PEBBLING_PULL_DEADLINE); what it fetched is kept for the "
                         "next pull", **FULL_DISK},
    "/api/create": FULL_DISK,
    "/api/copy": FULL_DISK,
    "/api/push": {"501": "not implemented: pebbling does not publish models"},
    "/api/delete": {"404": "Ollama's store has no model of that name"},
}


def install(app: FastAPI) -> None:
    """Makes `app.openapi()` return the document with pebbling's error responses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        components["Error"] = ERROR_SCHEMA
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                named = any(p.get("in") == "path" for p in operation.get("parameters", []))
                codes = {**EVERY_ROUTE, **(WITH_A_BODY if method in ("post", "put", "delete") else {}),
                         **(WITH_A_NAME if named else {}), **OWN_CODES.get(path, {})}
                if path == "/api/blobs/{digest}":
                    codes.pop("413", None)  # an upload streams to disk: no body limit
                if path in STREAMS and "200" in responses:
                    responses["200"].setdefault("content", {})[STREAMS[path]] = {"schema": {
                        "type": "string", "description": "the response in pieces as it is generated (with stream)"}}
                for code, description in codes.items():
                    responses.setdefault(code, {"description": description, **error})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi

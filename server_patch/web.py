"""The web page at the server's root, and the estimate it charts.

`GET /` answers a browser (an Accept that takes text/html) with the page, and every other client with the
plain "pebbling is running" Ollama's clients look for. The page (web/: HTML, CSS and plain scripts, no
build step) is served from the package; its policy lets it reach this server and nothing else.
`POST /api/pebbling/estimate` answers what `pebbling estimate` prints, as JSON.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from pyplugin.serving import ESTIMATE_OPTIONS, estimate_model

from .streaming import engine_of

RUNNING = "pebbling is running"
# The page's own files, by name, and their types; nothing else under /web/ is served.
ASSETS = {"style.css": "text/css; charset=utf-8", "draw.js": "text/javascript; charset=utf-8",
          "chat.js": "text/javascript; charset=utf-8", "estimate.js": "text/javascript; charset=utf-8"}
# What the page may load and reach: this server only (no CDN, no fonts, no frames, no inline script).
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache", "Vary": "Accept"}

router = APIRouter()


def _web_file(name: str) -> bytes:
    return files(__package__).joinpath("web", name).read_bytes()


def wants_html(accept: str) -> bool:
    """Whether an Accept header takes HTML (text/html or XHTML with a q above 0), as a browser's does; a
    bare `*/*` (curl, the SDKs) is answered in plain text."""
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() not in ("text/html", "application/xhtml+xml"):
            continue
        q = next((p.partition("=")[2] for p in params if p.lower().startswith("q=")), "1")
        try:
            return float(q) > 0
        except ValueError:
            return False
    return False


@router.head("/", include_in_schema=False)
@router.get("/", tags=["ollama"], response_class=PlainTextResponse,
            summary="\"pebbling is running\"; a browser (Accept: text/html) gets the web page",
            responses={200: {"content": {"text/html": {"schema": {"type": "string"}}},
                             "description": "plain text, or the web page where Accept takes text/html"}})
async def root(request: Request) -> Response:
    if wants_html(request.headers.get("accept", "")):
        return HTMLResponse(_web_file("index.html"), headers=PAGE_HEADERS)
    return PlainTextResponse(RUNNING, headers={"Vary": "Accept"})


@router.get("/web/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(status_code=404)
    return Response(_web_file(name), media_type=ASSETS[name], headers=PAGE_HEADERS)


class EstimateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str = Field(description="the model's name, as /api/tags lists it")
    options: Any = Field(None, description="what shapes the estimate, as a request's options: "
                                           + ", ".join(ESTIMATE_OPTIONS) + "; any other is refused")


@router.post("/api/pebbling/estimate", tags=["pebbling"],
             summary="each strategy's estimated peak and predicted speed, and adaptive's budgets (pebbling estimate)")
async def estimate(body: EstimateRequest, request: Request) -> dict[str, Any]:
    return await run_in_threadpool(estimate_model, engine_of(request), body.model, body.options)

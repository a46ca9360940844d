"""`pebbling list`, `ps`, `show MODEL` and `stop MODEL`: what a running `pebbling serve` has, asked over
its Ollama API and printed as `ollama` prints it."""

from __future__ import annotations

import argparse
import datetime
import json

from ..errors import PebblingError
from .chat import format_info
from .client import Client

SHOW_FIELDS = ("modelfile", "parameters", "template", "system", "license")
_SERVER = "Asks the pebbling server (pebbling serve) on $PEBBLING_HOST (default 127.0.0.1:11435)."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("list", aliases=["ls"], help="list the models the server can serve",
                              description="List the models the server can serve: the demo, the models "
                                          "directory and Ollama's store. " + _SERVER)
    p.set_defaults(func=list_models)
    p = subparsers.add_parser("ps", help="list the models the server has loaded",
                              description="List the models the server has loaded, as ollama ps does: where "
                                          "each one's weights are (PROCESSOR: the share in host memory and "
                                          "in device memory, estimated from its plan), its context and when "
                                          "it unloads. " + _SERVER)
    p.set_defaults(func=ps)
    p = subparsers.add_parser("show", help="show a model's details, template, parameters, license",
                              description="Show what the server's /api/show says of MODEL. " + _SERVER)
    p.add_argument("model", help="a model name, as pebbling list shows it")
    one = p.add_mutually_exclusive_group()
    for name in SHOW_FIELDS:
        one.add_argument(f"--{name}", action="store_true", help=f"print only the model's {name}")
    one.add_argument("--json", action="store_true", help="print the server's whole answer as JSON")
    p.set_defaults(func=show)
    p = subparsers.add_parser("stop", help="unload a model the server has loaded",
                              description="Unload MODEL now (a request with keep_alive 0). " + _SERVER)
    p.add_argument("model", help="a model name, as pebbling ps shows it")
    p.set_defaults(func=stop)


def list_models(args: argparse.Namespace) -> int:
    models = _ask(lambda c: c.get("/api/tags"))["models"]
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [[m["name"], m["digest"][:12], human_bytes(m["size"]), ago(now, _time(m["modified_at"]))]
            for m in models]
    print(format_table(["NAME", "ID", "SIZE", "MODIFIED"], rows))
    return 0


def ps(args: argparse.Namespace) -> int:
    models = _ask(lambda c: c.get("/api/ps"))["models"]
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [[m["name"], m["digest"][:12], human_bytes(m["size"]), processor(m), str(m.get("context_length", "")),
             until(now, _time(m["expires_at"]))] for m in models]
    print(format_table(["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"], rows))
    return 0


def processor(m: dict) -> str:
    """`ollama ps`'s PROCESSOR: "100% CPU", "100% GPU" or "48%/52% CPU/GPU", the share of the weights in
    host memory and in device memory. From pebbling's estimate of where its plan keeps them (/api/ps's
    pebbling object), else from Ollama's size and size_vram as `ollama ps` reads them."""
    placement = m.get("pebbling") or {}
    if "device_weight_bytes" in placement:
        gpu, total = placement["device_weight_bytes"], placement["device_weight_bytes"] + placement["host_weight_bytes"]
    else:
        gpu, total = m.get("size_vram") or 0, m.get("size") or 0
    if gpu <= 0:
        return "100% CPU"
    if gpu >= total:
        return "100% GPU"
    cpu = round(100 * (total - gpu) / total)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def show(args: argparse.Namespace) -> int:
    info = _ask(lambda c: c.post("/api/show", {"model": args.model}))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for name in SHOW_FIELDS:
        if getattr(args, name):
            # A field the model does not have is left out of /api/show, as Ollama leaves it: blank here,
            # as `ollama show --system` prints it.
            print((info.get(name) or "").rstrip("\n"))
            return 0
    print(format_info(info))
    return 0


def stop(args: argparse.Namespace) -> int:
    def unload(client: Client) -> None:
        running = {m["name"] for m in client.get("/api/ps")["models"]}
        if short_name(args.model) not in {short_name(name) for name in running}:
            raise PebblingError(f"model {args.model!r} is not loaded; loaded: {', '.join(sorted(running)) or 'none'}")
        client.post("/api/generate", {"model": args.model, "keep_alive": 0, "stream": False})

    _ask(unload)
    return 0


def short_name(name: str) -> str:
    """A name as `ollama ps` shows it: without Ollama's default host and namespace, with its tag."""
    name = name.removeprefix("registry.ollama.ai/").removeprefix("library/")
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _ask(call):
    client = Client()
    try:
        return call(client)
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------------
# printing as ollama prints


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns three spaces apart, as `ollama list` prints them."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])


def human_bytes(n: int) -> str:
    """Decimal units, as Ollama prints sizes: 4.7 GB, 46 MB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n} B"


def _time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _span(seconds: float) -> str:
    for unit, size in (("year", 365 * 86400), ("month", 30 * 86400), ("week", 7 * 86400), ("day", 86400),
                       ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''}"
    return "less than a second"


def ago(now: datetime.datetime, then: datetime.datetime) -> str:
    seconds = (now - then).total_seconds()
    return "just now" if seconds < 1 else f"{_span(seconds)} ago"


def until(now: datetime.datetime, then: datetime.datetime) -> str:
    if then.year >= 9999:
        return "Forever"
    seconds = (then - now).total_seconds()
    return "now" if seconds < 1 else f"{_span(seconds)} from now"

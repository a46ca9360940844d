"""`pebbling serve`: the Ollama- and OpenAI-compatible HTTP API, on loopback by default."""

from __future__ import annotations

import argparse
import logging.config
import os
import signal
import sys
from pathlib import Path

from ..errors import PebblingError
from ..kv_types import default_kv_type
from ..serving.registry import MODELS_ENV, default_models_dir
from ..serving.settings import HOST_ENV, ORIGINS_ENV, is_loopback
from .client import DEFAULT_HOST, DEFAULT_PORT, parse_host
from .common import plain

# pyplugin never imports the server (server_patch uses pyplugin, not the other way round); uvicorn
# imports the app factory by name. The factory reads the models directory from $PEBBLING_MODELS, which
# serve sets to the directory it chose (--models, else the rule every command shares).
APP_FACTORY = "server_patch.app:create_app"
# uvicorn's h11 protocol with header and body read timeouts and a connection cap (named, as the app is).
HTTP_PROTOCOL = "server_patch.connections:LimitedH11Protocol"
SWITCH_INTERVAL = 0.001  # seconds


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve models over Ollama's (and OpenAI's) HTTP API",
                              description=plain(__doc__))
    try:  # $PEBBLING_HOST is read as Ollama reads $OLLAMA_HOST: host, host:port or a URL
        where = parse_host(os.environ.get(HOST_ENV))
    except PebblingError:
        where = None  # said in one line when serve runs; other commands must still parse
    p.add_argument("--host", default=where and where.host,
                   help=f"address to listen on (default: the host of ${HOST_ENV}, else {DEFAULT_HOST}; on "
                        f"loopback the server answers only loopback names and local web pages, ${ORIGINS_ENV} allows more origins; "
                        "the API has no authentication, "
                        "so think twice before listening beyond loopback)")
    p.add_argument("--port", type=int, default=where and where.port,
                   help=f"port (default: the port of ${HOST_ENV}, else {DEFAULT_PORT})")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="info (default): a line per request, load and unload; debug: more (so does PEBBLING_DEBUG=1)")
    p.add_argument("--models", metavar="DIR", type=Path,
                   help=f"serve every NAME.gguf in DIR as NAME (default ${MODELS_ENV}, else ./models where it "
                        "is a directory, else ~/.cache/pebbling/models: where the other commands look too)")
    p.add_argument("--ray", action="store_true",
                   help="serve with Ray Serve: --replicas engines behind one address, each conversation kept on the "
                        "replica that holds its cache (needs pip install 'pebbling[ray]'; joins the cluster of "
                        "$RAY_ADDRESS, else starts one on this machine)")
    p.add_argument("--replicas", type=int, default=1, metavar="N", help="with --ray: how many engines (default 1)")
    p.add_argument("--gpus-per-replica", type=float, default=0, metavar="G",
                   help="with --ray: GPUs Ray gives each replica (default 0: CPU)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..serving.engine import describe

    default_kv_type()  # an unknown PEBBLING_KV_CACHE_TYPE stops the server before it starts, naming the accepted ones
    if args.host is None or args.port is None:
        where = parse_host(os.environ.get(HOST_ENV))  # the one-line error for a bad $PEBBLING_HOST
        args.host, args.port = args.host or where.host, where.port if args.port is None else args.port
    if args.models is not None:
        if not args.models.is_dir():
            raise PebblingError(f"--models {args.models}: not a directory; give the directory that "
                                "holds your .gguf files")
        os.environ[MODELS_ENV] = str(args.models.resolve())
    else:  # chosen here, once: the app and Ray's replicas (in directories of their own) serve this one
        os.environ[MODELS_ENV] = str(default_models_dir())
    if not 0 < args.port < 65536:
        raise PebblingError(f"--port {args.port}: choose a port from 1 to 65535")
    if args.ray:
        return _run_ray(args)
    if args.replicas != 1 or args.gpus_per_replica:
        raise PebblingError("--replicas and --gpus-per-replica go with --ray")
    if not is_loopback(args.host):
        print(f"pebbling: warning: listening on {args.host}, beyond loopback; the API has no "
              "authentication", file=sys.stderr)
    os.environ[HOST_ENV] = args.host  # the app answers Host names by where it listens
    _fewer_malloc_arenas()
    level = "debug" if os.environ.get("PEBBLING_DEBUG") else args.log_level
    _more_open_files()
    # Python hands the interpreter between threads every 5 ms by default; a template rendering or a decode
    # step on a worker thread would then hold the event loop (GET /, new connections) for 5 ms at a time,
    # several times per request. 1 ms keeps the loop answering within milliseconds under that load.
    sys.setswitchinterval(SWITCH_INTERVAL)
    config = log_config(level)
    logging.config.dictConfig(config)
    # Which backend computes, and what can be asked for.
    logging.getLogger("pebbling.server").info("%s", describe(os.environ.get(MODELS_ENV)))
    # A SIGTERM (a service manager, kill, make's own stop) is a clean stop: uvicorn shuts down gracefully,
    # then raises the signal again under the handler it found. With this one the process ends with status
    # 0 rather than dying of the signal, which `make serve` reported as "*** [Makefile:N: serve] Terminated".
    signal.signal(signal.SIGTERM, _stop_cleanly)
    uvicorn.run(APP_FACTORY, factory=True, host=args.host, port=args.port, log_level=level,
                log_config=config, http=HTTP_PROTOCOL)
    return 0


def _stop_cleanly(signum, frame) -> None:
    raise SystemExit(0)


RAY_CANNOT_START = "Ray cannot start"


def _run_ray(args: argparse.Namespace) -> int:
    """The Ray Serve application (pyplugin/serving/ray_deploy.py) on --host and --port, until interrupted."""
    if args.replicas < 1 or args.gpus_per_replica < 0:
        raise PebblingError(f"--replicas {args.replicas} --gpus-per-replica {args.gpus_per_replica}: give at "
                            "least 1 replica and no negative GPU count")
    try:
        import ray
        from ray import serve

        from ..serving.ray_deploy import build_app
    except ImportError as exc:
        raise PebblingError(f"--ray needs Ray Serve, which is not installed ({exc}); pip install 'pebbling[ray]'")
    if not is_loopback(args.host):
        print(f"pebbling: warning: listening on {args.host}, beyond loopback; the API has no "
              "authentication", file=sys.stderr)
    logging.config.dictConfig(log_config(args.log_level))
    # A cluster named by $RAY_ADDRESS is joined as it is; otherwise one starts here, without its dashboard.
    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(**({} if address else {"include_dashboard": False}))
    except Exception as exc:  # no shared memory, no free ports, a sandbox: not pebbling's bug
        where = f"join the Ray cluster at $RAY_ADDRESS ({address})" if address else "start a Ray cluster here"
        raise PebblingError(f"{RAY_CANNOT_START}: cannot {where}: {type(exc).__name__}: {exc}; serve without "
                            "--ray, or set $RAY_ADDRESS to a running cluster's address") from None
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app({"models": os.environ.get(MODELS_ENV), "num_replicas": args.replicas,
                     "num_gpus": args.gpus_per_replica, "host": args.host})
    print(f"pebbling: {args.replicas} replica(s) on Ray Serve at http://{args.host}:{args.port}", file=sys.stderr)
    serve.run(app, name="pebbling", route_prefix="/", blocking=True)
    return 0


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def log_config(level: str) -> dict:
    """uvicorn's logging, with a timestamp on every line and pebbling's own loggers at `level`."""
    stamped = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler = {"class": "logging.StreamHandler", "formatter": "stamped", "stream": "ext://sys.stderr"}
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"stamped": {"format": stamped}},
        "handlers": {"default": handler},
        "loggers": {name: {"handlers": ["default"], "level": level.upper(), "propagate": False}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "pebbling")},
    }


def _more_open_files(wanted: int = 8192) -> None:
    """Raises the soft limit on open files toward the hard one, so that the connection cap
    (PEBBLING_MAX_CONNECTIONS, default 4096), not the file limit (often 1024), is what refuses clients."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not on this system, or not allowed: keep what there is
        pass


def _fewer_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates an arena of its own and keeps what it frees there: with
    the server's pool of request threads, a burst of requests left the process 22 MiB larger than before
    it, against 5 MiB with two arenas (benchmarks/server.py limits). MALLOC_ARENA_MAX, when set,
    wins; elsewhere than glibc this does nothing."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass

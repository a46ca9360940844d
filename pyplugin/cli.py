"""The `pebbling` command. Each subcommand lives in pyplugin/commands/<name>.py and provides
``add_parser(subparsers)`` (which registers itself and sets ``func``); what they share is in
pyplugin/commands/common.py."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import PebblingError

# Order shown in --help; a module that is absent is simply not offered.
# models: list, ps, show, stop; manage: create, cp, rm, push
COMMANDS = ("run", "serve", "pull", "models", "manage", "estimate", "verify", "info", "fetch_demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pebbling",
        description="Run GGUF models in any GPU memory budget by streaming layer state.")
    parser.add_argument("--version", action="version", version=f"pebbling {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"pyplugin.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"pyplugin.commands.{name}":
                continue
            raise
        module.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pebbling")
    except PackageNotFoundError:  # a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that has gone is found here, not in the interpreter's exit
        return code
    except PebblingError as exc:
        print(f"pebbling: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pebbling list | head -1`: the reader has gone, as for any command in a pipe
        return _reader_gone()
    except Exception as exc:  # a bug, not bad input: one line, the traceback when asked for
        if os.environ.get("PEBBLING_DEBUG"):
            raise
        print(f"pebbling: internal error: {type(exc).__name__}: {exc} (run with PEBBLING_DEBUG=1 for the "
              "traceback, and report it)", file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """The exit of a command whose stdout was closed by its reader: quiet, with the status a shell gives
    a command ended by SIGPIPE. stdout is pointed at /dev/null first, so that the flush at exit does
    not fail again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (a test's capture): nothing to flush
        pass
    return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

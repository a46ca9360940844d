"""How an entry point runs its subcommands: `python benchmarks/ENTRY.py NAME [NAME's options]` imports the
module NAME names (only then: --help needs nothing but the standard library) and runs its main() on the rest
of the command line; `--help` after NAME is NAME's own."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def run(doc: str, commands: dict[str, tuple[str, str]], argv: list[str] | None = None) -> int:
    """`commands`: subcommand -> (its module, what it measures). The exit status is main()'s where it returns
    an int (a check that failed), else 0."""
    argv = sys.argv[1:] if argv is None else argv
    script = Path(sys.argv[0]).name
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, commands))
        print(doc.strip() + "\n\nsubcommands (each takes --help):")
        for name, (_, what) in commands.items():
            print(f"  {name:{width}}  {what}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{script}: no subcommand {name!r}; choose from {', '.join(commands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[name][0])
    sys.argv = [f"{script} {name}", *rest]  # argparse names the subcommand in its usage and errors
    status = module.main(rest)
    return status if isinstance(status, int) and not isinstance(status, bool) else 0

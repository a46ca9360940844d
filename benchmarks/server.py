"""The server under load and abuse: what decoding clients' requests together gains, what clients see of its
latency, whether it stays quick and bounded under hostile requests, and whether it holds for minutes of
everything at once.

    python benchmarks/server.py SUBCOMMAND [its options]      (SUBCOMMAND --help for them)

Each runs `pebbling serve` of this tree in a process of its own on loopback (`clients` can also take the
URL of a running server) over a small random-weight model written for the run. `limits` and `soak` say
PASS or FAIL beside their figures; `soak` exits 1 when the run did not hold.
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from lib.cli import run  # noqa: E402

COMMANDS = {
    "load": ("lib.server_load", "8 clients decoding at once against the same requests one at a time: aggregate "
                                "tok/s, bytes restored per token, answers equal to alone"),
    "clients": ("lib.server_clients", "concurrent clients against any server: requests/s, latency percentiles, "
                                      "tokens/s"),
    "limits": ("lib.server_limits", "GET / under megabyte prompts, templates at their limit and 1,000 slow "
                                    "connections; a burst past the queue limit; memory before and after"),
    "soak": ("lib.server_soak", "clients that never stop for --minutes: generate, chat, cut streams, pulls "
                                "through a registry that cuts downloads, create, copy, delete; no 5xx, no growth"),
}

if __name__ == "__main__":
    sys.exit(run(__doc__, COMMANDS))

"""The code behind the benchmarks' entry points (benchmarks/*.py): one module per subcommand, named
<entry>_<subcommand>, and the parts they share. Nothing here is run on its own; run an entry point.

Only the standard library is imported here and in cli.py: an entry point's --help, and gpu_check.py on a
machine where nothing is installed yet, need nothing more.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
ROOT = BENCHMARKS.parent


def entry(name: str) -> str:
    """The path of the entry point `name` (speed, memory, ...), for a command that runs it in a process."""
    return str(BENCHMARKS / f"{name}.py")


def ram_dir(requested: str | None, need_bytes: int) -> Path:
    """Where a benchmark's GGUF file is written: `requested`, else /dev/shm where more than `need_bytes`
    are free (memory, no disk write), else the temporary directory."""
    if requested:
        return Path(requested)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes:
        return shm
    return Path(tempfile.gettempdir())

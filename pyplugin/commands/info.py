"""`pebbling info`: which store backend would be used and why, what else is available, which GPUs."""

from __future__ import annotations

from ..store import available_backends, choose_backend
from ..store import gpu
from .common import plain

_GIB = 1 << 30


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("info", help="show the store backend, its library and the GPUs seen",
                                   description=plain(__doc__))
    parser.set_defaults(func=run)


def run(args) -> int:
    choice = choose_backend()
    print(f"backend: {choice.backend.name}")
    print(f"  why: {choice.reason}")
    print(f"  library: {choice.backend.library_path or 'none (pure Python)'}")
    native = choice.backend.name != "stub"
    print(f"decode step: {'one native call per token, every layer' if native else 'the Python forward pass'}"
          f"{'' if native else ' (the stub backend)'}")
    print("weights: quantized by default (their GGUF types); pebbling_weights: f16 expands them at load")
    print("backends available:")
    for found in available_backends():
        print(f"  {found.name}: {'yes' if found.usable else 'no'} ({found.reason})")
        if found.detail:
            print(f"    {found.detail}")
    gpus = gpu.list_gpus()
    problem = gpu.nvml_problem()
    if problem:
        print(f"no NVIDIA driver found ({problem})")
    elif not gpus:
        print("no NVIDIA GPU found (the driver lists none)")
    for g in gpus:
        print(f"GPU {g.index}: {g.name}, {g.total_bytes / _GIB:.1f} GiB total, "
              f"{g.free_bytes / _GIB:.1f} GiB free")
    return 0

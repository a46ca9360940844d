"""`pebbling estimate` on a real model's shape larger than this machine: gpt-oss-120b (36 layers of 2880, 128
experts of 2880 with 4 used, MXFP4 experts and Q8_0 elsewhere: 65 GB) by default.

    python benchmarks/memory.py estimate [--shape gpt-oss-120b] [--type MXFP4_MOE] [--expert-cache C]
        [--memory-limit SIZE] [--num-ctx N] [--dir D] [--json FILE]

The file is written with its tensors' data left as holes of a sparse file (synth's `holes`: the real size and
layout, zeros for data, on no disk), then `pebbling estimate` runs on it on the host backend computing from
the file's mapping (PEBBLING_USE_MMAP=1: the store borrows the pages, so the 65 GB are never copied). Its peaks,
smallest footprint and restored bytes are estimates from the shape; its restore bandwidth, store call and
layer time are measured on this machine, and its speeds predicted from them (labelled so by the command).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

from lib.shapes import FILES, SHAPES
from pyplugin import cli
from pyplugin.commands.estimate import render


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt-oss-120b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="MXFP4_MOE", choices=sorted(FILES))
    ap.add_argument("--expert-cache", type=int, help="pebbling_expert_cache: experts kept per layer")
    ap.add_argument("--memory-limit", help="the device budget each strategy is checked against (e.g. 8GiB)")
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--dir", type=Path, help="where the sparse file is written (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="write the estimate's JSON here")
    args = ap.parse_args(argv)
    from pyplugin.model.synth import write_gguf  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        shape = SHAPES[args.shape]
        path = directory / f"{args.shape}-{shape['n_layer']}L-shaped-{args.type}-holes.gguf"
        if not path.exists():
            write_gguf(path, **{**shape, **FILES[args.type](shape), "random_blocks": True, "holes": True,
                                "n_ctx": 131072})  # the released models' context length
        print(f"{path.name}: {path.stat().st_size / 2**30:.1f} GiB as a file, "
              f"{path.stat().st_blocks * 512 / 2**20:.1f} MiB on disk", flush=True)
        argv = ["estimate", str(path), "--backend", "host", "--num-ctx", str(args.num_ctx), "--json"]
        if args.expert_cache is not None:
            argv += ["--expert-cache", str(args.expert_cache)]
        if args.memory_limit:
            argv += ["--memory-limit", args.memory_limit]
        os.environ["PEBBLING_USE_MMAP"] = "1"  # the store borrows the file's pages: nothing copied
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(argv)
        if status:
            return status
        result = json.loads(out.getvalue())
        print(render(result))
        if args.json:
            result.pop("path", None)  # this machine's
            args.json.write_text(json.dumps(result, indent=1))
    return 0

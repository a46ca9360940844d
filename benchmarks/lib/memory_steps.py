"""Where one process's device memory goes over the life of its requests, step by step, as pebbling
measures it (NVML): after the CUDA context, a model's load, its first plan (the warm-up its overhead is
measured after), a first request, a longer prompt, a request from another thread, two sequences at once,
a streamed (minimal) request and a second model after the first closed; beside each, the overhead a new
plan would measure and the request's estimated and measured peaks. Prints one JSON line and a table.

    python benchmarks/memory.py steps [--backend cuda] [--layers 8] [--n-embd 64] [--n-ff 128]
        [--n-head 4] [--n-head-kv 2] [--num-batch 64]

The question it answers: which step loads memory that the warm-up did not (so that a floor named by
`estimate` in a fresh process differs from the server's after some requests). At a real width (4096,
14336, a prompt chunk of 128) it also shows whether a prompt's products load kernels the warm-up's short
chunk did not (cuBLAS loads a kernel's module when it is first used).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from pathlib import Path

from pyplugin.model import load_model
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.store import backend_named


SHAPE_ARGS = ("layers", "n_embd", "n_ff", "n_head", "n_head_kv", "num_batch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-ff", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-head-kv", type=int, default=2)
    parser.add_argument("--num-batch", type=int, default=64, help="a prompt's chunk: its products' shapes")
    args = parser.parse_args(argv)
    backend = backend_named(args.backend)
    steps: list[dict] = []

    def used() -> int | None:
        found = backend.used_memory()
        return found.bytes if found else None

    def step(name: str, **more) -> None:
        steps.append({"step": name, "used_bytes": used(), **more})

    step("start")
    backend.xp.zeros(4).sum().item()
    step("context and a kernel")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "model.gguf", n_layer=args.layers, n_embd=args.n_embd, n_head=args.n_head,
                          n_head_kv=args.n_head_kv, n_ff=args.n_ff, n_ctx=256, weight_type="Q8_0")
        model = load_model(path, progress=False)
        pebbled = PebbledModel(model, backend=backend)
        step("model loaded")
        options = Options(temperature=0, num_predict=4, num_ctx=256, num_batch=args.num_batch)

        def overhead(n_prompt: int, n_seqs: int = 1) -> int:
            return pebbled.memory_model(options, n_prompt, n_seqs=n_seqs).overhead_bytes

        step("first plan (warm-up)", overhead=overhead(33))

        def request(name: str, n_prompt: int, strategy: str = "none") -> None:
            pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy})
            gen = pebbled.generation(options, pebbling, n_prompt)
            tokens = list(gen.tokens([(7 * i) % 200 + 5 for i in range(n_prompt)]))
            report = gen.report()
            step(name, tokens=len(tokens), estimated_peak=report["estimated_peak_bytes"],
                 measured_peak=report["measured_peak_bytes"], overhead_now=overhead(n_prompt))

        request("request, 33-token prompt", 33)
        request("same request again", 33)
        request("request, 150-token prompt", 150)
        worker = threading.Thread(target=request, args=("request from another thread", 33))
        worker.start()
        worker.join()
        request("minimal (streamed)", 33, "minimal")
        step("two sequences planned", overhead=overhead(33, n_seqs=2))
        pebbled.close()
        backend.free_pool()
        step("model closed, pool freed")
        # As `run` then `estimate` in one process (the tests do): a second PebbledModel's own warm-up.
        pebbled = PebbledModel(model, backend=backend)
        step("second model's first plan", overhead=overhead(33))
        request("second model's request", 33)
        pebbled.close()
    print(json.dumps({"backend": args.backend, "shape": {k: getattr(args, k) for k in SHAPE_ARGS}, "steps": steps}))
    base = steps[0]["used_bytes"] or 0
    for s in steps:
        extra = {k: v for k, v in s.items() if k not in ("step", "used_bytes")}
        mib = f"{(s['used_bytes'] - base) / 2**20:8.1f}" if s["used_bytes"] is not None else "     n/a"
        print(f"{s['step']:32s} {mib} MiB  {extra}")
    return 0

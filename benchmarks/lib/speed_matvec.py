"""The matrix-vector kernels on Llama-3-8B's matrices, the weights read from device memory (not the L2):
GB/s of weights against the device's own copy bandwidth, at 1 and 8 vectors.

    python benchmarks/speed.py matvec [--backend cuda|host] [--libs A.so,VAR=V,B.so] [--vectors 1,8]
        [--repeats 9] [--scale 1.0] [--json FILE] [--best FILE]

Each matrix is random blocks of its type (each scale a small finite fp16, as files have), in enough
copies that one round of calls reads over 3x the L2 (so the weights come from memory, as a decode step's
do); a round is timed on the host clock with the device synchronized, the median of --repeats rounds kept,
and each call's time is the round's over its calls: each call is made from Python, so a small matrix's
time is the call's own cost (about 26 us on the H200 machine), not its kernel's. The device's bandwidth
is `speed.py gpu`'s device-to-device copy of 1 GiB in the same run (bytes read + written over its time).

--libs: the same in one process per item, side by side: a library path (PEBBLING_LIB), to compare builds
of the cuda library (PEBBLE_MATVEC_ROWS, PEBBLE_Q8_CHUNK, PEBBLE_Q8_CHUNK_FEW, PEBBLE_MATVEC_WARP_ROWS,
PEBBLE_MATVEC_LOADS and PEBBLE_MATVEC_UNROLL set by -D), settings of its switches (VAR=VALUE, such as PEBBLING_CUDA_PERSIST=0: docs/environment.md), or
both, joined by + (a build with settings; settings alone are the default library's); each item's matrix-vector time of one Llama-3-8B Q4_K_M
token is printed, and --best writes the fastest item (the first unless another is over 3% faster) to a
file. Each item's products are checked: every output written, and equal to the first item's bit for bit
(the items change which warps and stagings sum a row's parts, never their order); exit 1 otherwise. On host the clock is the host's and the
"device" a memcpy; --scale shrinks the rows there: a check of this script, not a GPU figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from lib import entry
from lib.speed_gpu import hbm_bandwidth
from pyplugin.runtime.measure import median_seconds
from pyplugin.store import backend_named
from pyplugin.xp import to_numpy

# Llama-3-8B's matrices as Q4_K_M lays them out (attn_v, ffn_down and the output in Q6_K), and its ffn_up in
# Q5_K (Q5_K_M files), Q5_0 (what Q4_K_M files hold where rows are not whole 256s), Q8_0 and F16.
SHAPES = [("Q4_K", 14336, 4096, "ffn_gate, ffn_up"), ("Q6_K", 4096, 14336, "ffn_down"),
          ("Q4_K", 4096, 4096, "attn_q, attn_output"), ("Q4_K", 1024, 4096, "attn_k"), ("Q6_K", 1024, 4096, "attn_v"),
          ("Q6_K", 128256, 4096, "output"), ("Q5_K", 14336, 4096, "ffn_up (Q5_K)"),
          ("Q5_0", 14336, 4096, "ffn_up (Q5_0)"), ("Q8_0", 14336, 4096, "ffn_up (Q8_0)"),
          ("F16", 14336, 4096, "ffn_up (F16)")]
SCALE_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,)}  # fp16 scales
PER_TOKEN = {"ffn_gate, ffn_up": 64, "ffn_down": 32, "attn_q, attn_output": 64, "attn_k": 32, "attn_v": 32,
             "output": 1}  # each matrix's calls in a Llama-3-8B Q4_K_M token (32 layers)
NOISE = 0.03  # a library is picked over the first only when its token is this much faster
L2_BYTES = 60 << 20  # an H200's (probe reads it); over 3x that per round leaves none in the cache


def random_blocks(xp, qtype: Q, n_rows: int, n_cols: int, rng) -> object:
    """n_rows rows of random blocks of qtype, made where they are used (a 431 MB output matrix takes
    seconds in numpy), each block's scales set to 0.01; F16 standard normal values."""
    if qtype == Q.F16:
        return rng.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8)
    elements, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.randint(0, 256, size=(n_rows * n_cols // elements, block_bytes), dtype=np.uint8)
    scale = xp.asarray(np.frombuffer(np.float16(0.01).tobytes(), np.uint8))
    for at in SCALE_AT[qtype]:
        blocks[:, at:at + 2] = scale
    return blocks.reshape(n_rows, -1)


def graph_seconds(backend, round_, calls: int, repeats: int) -> tuple[float | None, str]:
    """A call's time on the GPU alone: `round_` (its `calls` calls) captured once as a CUDA graph and replayed,
    CUDA events around each replay, so that no Python stands between the launches (a call from Python takes
    about 26 us on the H200, longer than most of these kernels); None and why where it cannot be."""
    if not backend.arrays_on_device:
        return None, "no GPU: a call's time is its kernel's"
    cp = backend.xp
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        with stream:
            round_()  # the library's first-call set-up, outside the capture
            stream.begin_capture()
            try:
                round_()
            finally:
                graph = stream.end_capture()
            start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
            for _ in range(repeats + 1):
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return float(np.median(times[1:])) / calls, "a CUDA graph of the round, replayed between CUDA events"
    except Exception as exc:  # noqa: BLE001 - a capture the library or the driver refuses is recorded, not fatal
        return None, f"not captured ({type(exc).__name__}: {str(exc)[:160]})"


def measure(name: str, vectors: list[int], repeats: int, scale: float) -> dict:
    backend = backend_named(name)
    kernels, xp, gpu = backend.kernels, backend.xp, backend.measures_memory
    copy = hbm_bandwidth(backend, int((1 << 30) * (1 if gpu else scale)), repeats)
    rng = xp.random.RandomState(0)
    rows = []
    for type_name, n_rows, n_cols, what in SHAPES:
        qtype = Q[type_name]
        n_rows = max(256, int(n_rows * scale)) if not gpu else n_rows
        one = random_blocks(xp, qtype, n_rows, n_cols, rng)
        copies = max(2, -(-3 * L2_BYTES // one.nbytes)) if gpu else 2
        weights = [one.copy() for _ in range(copies)]
        for nv in vectors:
            x = rng.standard_normal((nv, n_cols)).astype(np.float16)
            out = xp.full((nv, n_rows), np.nan, np.float32)  # every output must be written

            def round_() -> None:
                for w in weights:
                    kernels.matvec(int(qtype), w, n_rows, n_cols, x, out=out)

            per_call = median_seconds(round_, backend.synchronize, repeats) / copies
            kernel, kernel_how = graph_seconds(backend, round_, copies, repeats)
            got = to_numpy(out)  # the last copy's products, which are every copy's (the same bytes)
            rows.append({"type": type_name, "rows": n_rows, "cols": n_cols, "tensor": what, "vectors": nv,
                         "outputs": hashlib.sha256(got.tobytes()).hexdigest()[:16],
                         "unwritten": int(np.isnan(got).sum()),
                         "weight_bytes": one.nbytes, "copies": copies, "us": per_call * 1e6,
                         "GBps": one.nbytes / per_call / 1e9, "of_copy": one.nbytes / per_call / 1e9 / copy["GBps"],
                         "kernel_us": kernel and kernel * 1e6, "kernel_how": kernel_how,
                         "kernel_of_copy": kernel and one.nbytes / kernel / 1e9 / copy["GBps"]})
    result = {"backend": name, "library": os.environ.get("BENCH_MATVEC_ITEM") or os.environ.get("PEBBLING_LIB", "(default)"),
              "copy_GBps": copy["GBps"],
              "copy_how": copy["how"], "rows": rows}
    result["token_ms"] = {str(nv): token_seconds(result, nv) * 1e3 for nv in vectors}
    if all(r["kernel_us"] for r in rows):
        result["token_kernel_ms"] = {str(nv): token_seconds(result, nv, "kernel_us") * 1e3 for nv in vectors}
    return result


def item_env(item: str) -> dict[str, str]:
    """The environment of one --libs item: parts joined by +, each a library path or a VAR=VALUE setting."""
    env = {"BENCH_MATVEC_ITEM": item}
    for part in item.split("+"):
        name, is_setting, value = part.partition("=")
        env.update({name: value} if is_setting else {"PEBBLING_LIB": str(Path(part).resolve())})
    return env


def token_seconds(result: dict, vectors: int, key: str = "us") -> float:
    """The matrix-vector time of one Llama-3-8B Q4_K_M token at `vectors` vectors (a step of that batch), of
    each call from Python (`us`) or of its kernels alone (`kernel_us`)."""
    return sum(PER_TOKEN[r["tensor"]] * r[key] / 1e6 for r in result["rows"]
               if r["vectors"] == vectors and r["tensor"] in PER_TOKEN)


def best(results: list[dict]) -> dict:
    """The library whose tokens (summed over the vector counts) take least, the first unless another is
    over NOISE faster."""
    key = "kernel_us" if all("token_kernel_ms" in r for r in results) else "us"  # the kernels where measured

    def total(r: dict) -> float:
        return sum(token_seconds(r, nv, key) for nv in {row["vectors"] for row in r["rows"]})
    fastest = min(results, key=total)
    return fastest if total(fastest) < (1 - NOISE) * total(results[0]) else results[0]


def label(result: dict) -> str:
    """An item's library by its file name, with its settings."""
    return "+".join(part if "=" in part else Path(part).name for part in result["library"].split("+"))


def output_differences(results: list[dict]) -> list[str]:
    """Where an item's products are not #1's bit for bit, or leave outputs unwritten. Each item sums a row's
    parts in the same order (the builds and switches change which warps and stagings take them, not the
    order), so any difference is a fault of the item, not rounding."""
    found = []
    for i, r in enumerate(results):
        for j, row in enumerate(r["rows"]):
            where = f"#{i + 1} {row['type']} {row['rows']}x{row['cols']} at {row['vectors']} vector(s)"
            if row.get("unwritten"):
                found.append(f"{where}: {row['unwritten']} outputs unwritten")
            first = results[0]["rows"][j] if j < len(results[0]["rows"]) else None
            if i and first is not None and row.get("outputs") != first.get("outputs"):
                found.append(f"{where}: products differ from #1's")
    return found


def outputs_text(results: list[dict]) -> str:
    found = output_differences(results)
    if not found:
        return f"outputs: every product written, each item's equal to #1's bit for bit ({len(results)} items)"
    return "outputs: " + "; ".join(found[:12]) + (f"; and {len(found) - 12} more" if len(found) > 12 else "")


def table(results: list[dict]) -> str:
    lines = [f"#{i + 1}: {label(r)}, copy {r['copy_GBps']:.0f} GB/s ({r['copy_how']})" for i, r in enumerate(results)]
    lines.append("each call from Python: a small matrix's time is the call's cost, not its kernel's")
    head = f"{'type':5} {'shape':>13} {'vec':>3} " + " ".join(f"{'#' + str(i + 1):>26}" for i in range(len(results)))
    lines += [head, "-" * len(head)]
    for i, row in enumerate(results[0]["rows"]):
        cells = " ".join(f"{r['rows'][i]['us']:9.2f} us {r['rows'][i]['GBps']:6.0f} GB/s {r['rows'][i]['of_copy']:4.0%}"
                         if i < len(r["rows"]) else f"{'-':>26}" for r in results)
        lines.append(f"{row['type']:5} {row['rows']:>6}x{row['cols']:<6} {row['vectors']:>3} {cells}")
    lines.append(outputs_text(results))
    kernels = [r for r in results if "token_kernel_ms" in r]
    if kernels:
        lines.append(f"each call's kernels alone ({results[0]['rows'][0]['kernel_how']}):")
        for i, row in enumerate(results[0]["rows"]):
            cells = " ".join(f"{r['rows'][i]['kernel_us']:9.2f} us {r['rows'][i]['kernel_of_copy']:4.0%}"
                             if "token_kernel_ms" in r and i < len(r["rows"]) else f"{'-':>17}" for r in results)
            lines.append(f"{row['type']:5} {row['rows']:>6}x{row['cols']:<6} {row['vectors']:>3} {cells}")
    else:
        lines.append(f"kernels alone: {results[0]['rows'][0]['kernel_how']}" if results[0]["rows"] else "")
    for nv in sorted({row["vectors"] for row in results[0]["rows"]}):
        lines.append(f"Llama-3-8B Q4_K_M matvecs a token (each matrix's measured call x its calls), {nv} vector(s): "
                     + ", ".join(f"{token_seconds(r, nv) * 1e3:.3f} ms" for r in results))
        if kernels:
            lines.append(f"... their kernels alone, {nv} vector(s): " + ", ".join(
                f"{token_seconds(r, nv, 'kernel_us') * 1e3:.3f} ms" if "token_kernel_ms" in r else "-" for r in results))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--libs", default="", help="comma-separated items, each a library path, VAR=VALUE "
                        "settings, or both joined by +, each run in its own process")
    parser.add_argument("--vectors", default="1,8")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--scale", type=float, default=1.0, help="rows x scale off the GPU (a check)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--best", type=Path, help="write the fastest library's path here (see best())")
    args = parser.parse_args(argv)
    vectors = [int(v) for v in args.vectors.split(",")]
    if not args.libs:
        results = [measure(args.backend, vectors, args.repeats, args.scale)]
    else:
        results = []
        for lib in args.libs.split(","):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                argv_one = [sys.executable, entry("speed"), "matvec", "--backend", args.backend, "--vectors",
                            args.vectors, "--repeats", str(args.repeats), "--scale", str(args.scale), "--json", out.name]
                done = subprocess.run(argv_one, env={**os.environ, **item_env(lib)}, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{lib}: exit {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
                    continue
                results.extend(json.loads(Path(out.name).read_text()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results) if results else "no library ran")
    if args.best and results:
        chosen = best(results)
        args.best.write_text(chosen["library"])
        print(f"best: {chosen['library']}")
    return 0 if results and not output_differences(results) else 1


"""What a GPU machine is and whether pebbling runs on it: the first stage of gpu_check.py.

    python benchmarks/memory.py probe [--backend cuda|host]

Prints what it finds (nvidia-smi, NVML's driver and CUDA versions, CuPy's device, the native library,
`pebbling info`; for cuda, the device memory of the context, cuBLAS and threads, and a model's requests
step by step through `memory.py steps`), then one last line of JSON with every figure. Exit 0 when the
library of --backend loads and `pebbling info` selects that backend (and, for cuda, CuPy reaches the
device); 1 otherwise, saying why.
Every figure here is read from the machine; what cannot be read is recorded as null with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lib import ROOT, entry


def _run(command: list[str], timeout: float = 60, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return done.returncode, (done.stdout + done.stderr).strip()


def nvidia_smi() -> dict:
    if not shutil.which("nvidia-smi"):
        return {"present": False, "why": "nvidia-smi is not on PATH"}
    rc, table = _run(["nvidia-smi"])
    print(table)
    fields = "name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max,clocks.max.memory"
    rc_q, csv = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"])
    gpus = [dict(zip(fields.split(","), (v.strip() for v in line.split(","))))
            for line in csv.splitlines() if rc_q == 0 and line.strip()]
    return {"present": True, "rc": rc, "gpus": gpus}


def nvml() -> dict:
    try:
        import pynvml as n  # nvidia-ml-py
        n.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - any failure is a finding, recorded
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
    try:
        cuda = n.nvmlSystemGetCudaDriverVersion()
        out = {"ok": True, "driver": _text(n.nvmlSystemGetDriverVersion()),
               "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}", "gpus": []}
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            mem = n.nvmlDeviceGetMemoryInfo(h)
            gpu = {"name": _text(n.nvmlDeviceGetName(h)), "total_bytes": int(mem.total), "free_bytes": int(mem.free)}
            try:  # the bus's nominal rate: an estimate from the link, labelled so by the caller
                gpu["pcie_gen_max"] = int(n.nvmlDeviceGetMaxPcieLinkGeneration(h))
                gpu["pcie_width_max"] = int(n.nvmlDeviceGetMaxPcieLinkWidth(h))
            except n.NVMLError:
                pass
            out["gpus"].append(gpu)
        return out
    finally:
        n.nvmlShutdown()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cupy_device() -> dict:
    try:
        import cupy
        dev = cupy.cuda.Device(0)
        props = cupy.cuda.runtime.getDeviceProperties(0)
        (cupy.arange(4) + 1).sum().item()  # a kernel runs
        return {"ok": True, "cupy": cupy.__version__, "runtime": cupy.cuda.runtime.runtimeGetVersion(),
                "driver": cupy.cuda.runtime.driverGetVersion(), "name": _text(props["name"]),
                "compute_capability": dev.compute_capability, "multiprocessors": props["multiProcessorCount"],
                "l2_bytes": props["l2CacheSize"], "memory_bus_bits": props.get("memoryBusWidth")}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}


def device_memory() -> dict:
    """What device memory the pieces of a process take, as pebbling measures it (NVML): whether NVML lists
    this process (else the whole device is what is measured, other processes too), and the bytes after the
    context and a kernel, after a matrix product (cuBLAS's handle and workspace), after one on each of two
    new streams (pebbling computes on a stream of its own), and in a thread while it lives and after it
    ends (CuPy makes a handle per thread, as a server's model threads do), and the time of a prefill's
    product (512 x 4096 by 4096 x 14336, fp16). The same again in a process for each of WORKSPACES
    (CUBLAS_WORKSPACE_CONFIG): what a handle costs and what its workspace buys."""
    out = _memory_pieces()
    out["with_workspace"] = {}
    for config in WORKSPACES:
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": config}
        rc, text = _run([sys.executable, entry("memory"), "probe", "--pieces-only"], env=env)
        found = _last_json(text)
        out["with_workspace"][config] = found if rc == 0 and "why" not in found else {"rc": rc, **found}
    return out


def _last_json(text: str) -> dict:
    """The last line of a child's output that is a JSON object, else why there is none (its output's end)."""
    last = [line for line in text.splitlines() if line.startswith("{")][-1:]
    try:
        return json.loads(last[0]) if last else {"why": text[-1000:]}
    except json.JSONDecodeError:
        return {"why": text[-1000:]}


# cuBLAS's documented form :KiB:count: two 4 MiB buffers, and none (pebbling's setting, pyplugin.xp)
WORKSPACES = (":4096:2", ":0:0")


def _memory_pieces() -> dict:
    import threading

    try:
        import cupy
        from pyplugin.store import gpu

        def used() -> int | None:
            now = gpu.used_device_memory()
            return now.bytes if now else None

        steps = {"start": used()}
        (cupy.arange(4) + 1).sum().item()
        steps["context_and_a_kernel"] = used()
        a = cupy.ones((512, 512), dtype=cupy.float16)
        (a @ a).sum().item()
        steps["a_matrix_product"] = used()
        for n in (1, 2):
            with cupy.cuda.Stream(non_blocking=True):
                (a @ a).sum().item()
            steps[f"a_product_on_new_stream_{n}"] = used()
        computed, measured = threading.Event(), threading.Event()

        def in_thread():
            (a @ a).sum().item()
            computed.set()
            measured.wait(30)

        worker = threading.Thread(target=in_thread)
        worker.start()
        computed.wait(30)
        steps["a_product_in_a_living_thread"] = used()
        measured.set()
        worker.join()
        steps["that_thread_ended"] = used()
        cupy.get_default_memory_pool().free_all_blocks()
        steps["pool_freed"] = used()
        # what the workspace costs a prefill's product: 512 tokens through a 14336 x 4096 fp16 matrix
        x, w = (cupy.random.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)
                for s in ((512, 4096), (4096, 14336)))
        times = []
        for _ in range(21):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            x @ w
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
        prefill_us = sorted(times[1:])[10]
        use = gpu.used_device_memory()
        return {"ok": True, "how": use.how, "this_process": use.this_process, "bytes": steps,
                "workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "(cuBLAS's default)"),
                "prefill_product_us": round(prefill_us, 1)}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}


def memory_steps() -> dict:
    """`memory.py steps` in a process of its own: a model's device memory step by step, for
    the tiny model and for one layer of Llama-3-8B's width with prompt chunks of 128."""
    found = {}
    for name, extra, timeout in (("tiny", [], 60), ("llama3_8b_width", WIDE, 120)):
        rc, text = _run([sys.executable, entry("memory"), "steps", *extra], timeout=timeout)
        print(text)
        found[name] = {"rc": rc, **_last_json(text)}
    return found


WIDE = ["--layers", "1", "--n-embd", "4096", "--n-ff", "14336", "--n-head", "32", "--n-head-kv", "8", "--num-batch", "128"]


def library(kind: str) -> dict:
    try:
        from pyplugin.store.native import load_library
        _, path = load_library(kind)
        return {"ok": True, "path": str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else path,
                "bytes": Path(path).stat().st_size}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}


def pebbling_info() -> dict:
    rc, text = _run([sys.executable, "-m", "pyplugin.cli", "info"])
    print(text)
    first = text.splitlines()[0] if text else ""
    return {"rc": rc, "backend": first.split(":", 1)[1].strip() if first.startswith("backend:") else None,
            "text": text[-2000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--pieces-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pieces_only:  # device_memory's second process
        print(json.dumps(_memory_pieces()))
        return 0
    found = {"python": sys.version.split()[0], "nvidia_smi": nvidia_smi(), "nvml": nvml(),
             "library": library(args.backend), "pebbling_info": pebbling_info()}
    if args.backend == "cuda":
        found["cupy"] = cupy_device()
        found["device_memory"] = device_memory()
        print(f"device memory ({found['device_memory'].get('how')}): {found['device_memory'].get('bytes')}")
        found["memory_steps"] = memory_steps()
    problems = []
    if not found["library"]["ok"]:
        problems.append(f"the {args.backend} library: {found['library']['why']}")
    if found["pebbling_info"]["backend"] != args.backend:
        problems.append(f"pebbling info selects {found['pebbling_info']['backend']!r}, not {args.backend!r}")
    if args.backend == "cuda" and not found["cupy"]["ok"]:
        problems.append(f"CuPy: {found['cupy']['why']}")
    found["problems"] = problems
    for problem in problems:
        print(f"probe: {problem}", file=sys.stderr)
    print(json.dumps(found))
    return 1 if problems else 0

"""One command that proves pebbling on a GPU machine (make gpu-check DIR=...), within 9 minutes.

    python benchmarks/gpu_check.py --dir DIR [--backend cuda|host] [--stages probe,kernels,tests,bench]
        [--budget-s 530] [--tests PATH ...] [--kernel-tests PATH ...] [--test-workers N] [--bench-args ARGS]

On a bare machine (the GPU image's Python with CuPy, torch, transformers, accelerate; no registry):
  setup    installs what is missing from the wheels in .whl/ (make gpu-wheels: `gpu_check.py wheels`),
           --no-index, into a folder of its own on PYTHONPATH beside the tree (a pinned package already
           importable is left as it is), and the benchmark's peers from .peers/ where there are any
           (docs/gpu.md); uses build/libpebble_cuda.so as carried (builds it only where it is missing and
           nvcc exists)
  probe    `memory.py probe`: nvidia-smi, driver and CUDA versions, CuPy's device, the library
           loads, `pebbling info` selects the backend
  kernels  the kernel tests first, under CUDA_LAUNCH_BLOCKING=1, so that a fault names its kernel; where
           any fail on cuda, they run again under each of SWITCHES (docs/environment.md: each puts back
           the way the decode step ran before), and then under all of them, logged after the kernels'
           run: which change is at fault, named in the same call
  tests    the rest of the suite on the backend, with --no-skip-gpu: a skipped GPU test is a failure
           (in 4 processes where pytest-xdist imports: --test-workers)
  bench    `speed.py gpu` (scaled by --bench-args to fit the time left)
  profile  ncu's time of each kernel of the decode steps alone (`speed.py gpu --profile-decode` turns the
           profiler on for them; CUDA graphs off) while `speed.py gpu` runs one layer of the shape with its
           output, batch 1, 8 tokens after a 512-token prompt: where a decode step's time goes (cuda only;
           where ncu is not found, recorded so)
  matvec   `speed.py matvec` over build/libpebble_<backend>.so and every build in build/variants/
           (each a -D setting of the integer matvec, made where nvcc is and carried), on cuda the library
           also with PEBBLING_CUDA_PERSIST=0: each one's time of a Llama-3-8B Q4_K_M token's products, side
           by side, and each one's products checked equal to the library's bit for bit
Each stage is timed and has a timeout (its cap in CAPS, or --cap, within the time left of --budget-s,
keeping FLOOR seconds for each later stage); one that times out or fails is recorded and the next runs.
DIR gets: gpu_check.json (every stage's command, rc, time, timeout, pass/fail/skip counts and failures, the
probe's findings, the benchmark's and the matvec comparison's JSON, the kernels' times), summary.txt and
one log per stage: at most 8 files, flat, so that a machine which hands back only a few files returns them
all. Exit 0 when every stage passed. --backend host runs the same on a CPU machine (without --no-skip-gpu)
to check this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lib import ROOT, entry
from lib.wheels import read_pins, wheel_name

STAGES = ("probe", "kernels", "tests", "bench", "profile", "matvec")
KERNEL_TESTS = ["tests/test_quant_kernels.py", "tests/test_decode_step.py", "tests/test_attend.py"]
CAPS = {"setup": 120, "build": 300, "probe": 120, "kernels": 150, "tests": 270, "bench": 240, "profile": 90,
        "matvec": 120}
FLOOR = {"probe": 20, "kernels": 45, "tests": 90, "bench": 60, "profile": 40, "matvec": 30}  # a later stage's least
# Settings that each put back one change of the decode step (docs/environment.md), tried where kernel tests fail.
SWITCHES = ("PEBBLING_CUDA_STACK=0", "PEBBLING_CUDA_GROUP=1", "PEBBLING_CUDA_PERSIST=0", "PEBBLING_CUDA_SPLIT=0",
            "PEBBLING_CUDA_MATVEC=float", "PEBBLING_CUDA_DENSE=0")
SWITCHES_CAP = 150  # seconds for all of their runs together, within the budget
PROFILE_ARGS = "--layers 1 --types Q4_K_M --rows none --batches 1 --prompt 512 --tokens 8 --peers none --profile-decode"
# The benchmark inside the 9 minutes: a slice of the Llama-3-8B shape. The full run is its own command
# (docs/gpu.md).
DEFAULT_BENCH_ARGS = "--layers 4 --prompt 128 --tokens 16 --types Q4_K_M,F16"


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    junit: str | None = None      # pytest's report, for the counts


@dataclass
class Record:
    name: str
    command: str
    timeout_s: float
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    ok: bool = False
    log: str | None = None
    counts: dict | None = None
    failures: list = field(default_factory=list)
    skips: list = field(default_factory=list)
    last_test: str | None = None  # the last test a timed-out pytest started
    note: str = ""
    switches: dict | None = None  # kernels: each of SWITCHES's runs of the failed tests (see try_switches)


def run_stage(stage: Stage, out_dir: Path, base_env: dict[str, str], log_name: str | None = None) -> Record:
    """Runs one stage as its own process group, output to DIR/<name>.log (or after what DIR/<log_name>
    holds); past its timeout the group is ended (TERM, then KILL) and the record says so."""
    log = out_dir / (log_name or f"{stage.name}.log")
    record = Record(stage.name, shlex.join(stage.argv), round(stage.timeout_s, 1), log=log.name)
    start = time.monotonic()
    with open(log, "a" if log_name else "w") as sink:
        sink.write(f"$ {record.command}\n")
        sink.flush()
        try:
            proc = subprocess.Popen(stage.argv, cwd=ROOT, env={**base_env, **stage.env}, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            record.note = f"could not start: {exc}"
            return record
        try:
            record.rc = proc.wait(timeout=stage.timeout_s)
        except subprocess.TimeoutExpired:
            record.timed_out = True
            _end_group(proc)
    record.seconds = round(time.monotonic() - start, 2)
    if stage.junit:
        _read_pytest(record, Path(stage.junit), log)
    record.ok = record.rc == 0 and not record.timed_out
    if record.timed_out:
        record.note = f"timed out after {stage.timeout_s:.0f} s" + (f" in {record.last_test}" if record.last_test else "")
    return record


def _end_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


_VERBOSE = re.compile(r"(?:^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS))|"
                      r"(?:\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+))")


def _read_pytest(record: Record, junit: Path, log: Path) -> None:
    """Counts and failures from pytest's junit XML; after a timeout (no XML) from its verbose log."""
    if junit.is_file():
        try:
            root = ET.parse(junit).getroot()
        except ET.ParseError:
            root = None
        if root is not None:
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
            total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
            record.counts = {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
                             "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"],
                             "from": "junit"}
            for case in root.iter("testcase"):
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                for kind in ("failure", "error", "skipped"):
                    node = case.find(kind)
                    if node is not None:
                        entry = {"test": test, "kind": kind, "message": (node.get("message") or "")[:400]}
                        (record.skips if kind == "skipped" else record.failures).append(entry)
            record.failures, record.skips = record.failures[:100], record.skips[:100]
            return
    counts, last = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}, None
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
           "XFAIL": "skipped"}
    for line in log.read_text(errors="replace").splitlines():
        m = _VERBOSE.search(line)
        if m:
            counts[key[m.group(2) or m.group(3)]] += 1
            last = m.group(1) or m.group(4)
        elif "::" in line and line.startswith("tests/"):
            last = line.split()[0]
    record.counts = {**counts, "from": "log (no junit: the run did not finish)"}
    record.last_test = last


def node_id(test: str) -> str:
    """pytest's id of a junit test name (tests.test_x::name[params] -> tests/test_x.py::name[params])."""
    module, _, name = test.partition("::")
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):  # the module's file, then any classes inside it
        path = Path(*parts[:cut]).with_suffix(".py")
        if (ROOT / path).is_file():
            return "::".join([str(path), *parts[cut:], name])
    return test


def try_switches(failed: Record, pytest: list[str], env: dict[str, str], out_dir: Path, seconds: float) -> dict:
    """The failed kernel tests again under each of SWITCHES, then under all of them: passed and failed for
    each, so that the change at fault is named. Logged after the kernels' run; within `seconds` in all."""
    ids = sorted({node_id(f["test"]) for f in failed.failures})[:40]
    settings = [*SWITCHES, "+".join(SWITCHES)]
    found, end = {"tests": ids}, time.monotonic() + seconds
    for setting in settings:
        left = end - time.monotonic()
        if left < 10:
            found[setting] = {"note": "not run: out of time"}
            continue
        junit = out_dir / ".switch.xml"
        stage = Stage("kernels", [*pytest, f"--junitxml={junit}", *ids], left,
                      {**env, **dict(part.split("=", 1) for part in setting.split("+"))}, str(junit))
        with open(out_dir / failed.log, "a") as sink:
            sink.write(f"\n\n=== the failed tests again with {setting}\n")
        run = run_stage(stage, out_dir, {}, log_name=failed.log)
        junit.unlink(missing_ok=True)
        found[setting] = {"passed": (run.counts or {}).get("passed", 0), "failed": (run.counts or {}).get("failed", 0)
                          + (run.counts or {}).get("errors", 0), "seconds": run.seconds, "timed_out": run.timed_out}
    return found


def switches_text(found: dict) -> str:
    return "; ".join(f"{k}: " + (v["note"] if "note" in v else f"{v['passed']} passed, {v['failed']} failed")
                     for k, v in found.items() if k != "tests")


# ---------------------------------------------------------------------------------------------------
# setup


def install_missing(wheels: Path, site: Path, python: str) -> tuple[Record, list[str]]:
    """Installs each pinned distribution that is not installed, from its wheel, into `site`."""
    from importlib import metadata

    record = Record("setup", "", CAPS["setup"], log=None)
    start = time.monotonic()
    missing = []
    for name, version in read_pins().items():
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    files = {wheel_name(w.name)[0]: w for w in wheels.glob("*.whl")} if wheels.is_dir() else {}
    absent = [n for n in missing if n not in files]
    record.counts = {"pinned": len(read_pins()), "already_installed": len(read_pins()) - len(missing),
                     "to_install": len(missing), "no_wheel": len(absent)}
    if missing and len(absent) < len(missing):
        argv = [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--disable-pip-version-check", "--target", str(site),
                *(str(files[n]) for n in missing if n in files)]
        record.command = shlex.join(argv[:12]) + " ..."
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CAPS["setup"])
            record.rc, record.note = done.returncode, done.stderr[-1500:]
        except subprocess.TimeoutExpired:
            record.timed_out, record.note = True, f"pip install timed out after {CAPS['setup']} s"
    else:
        record.rc = 0
    record.seconds = round(time.monotonic() - start, 2)
    record.ok = record.rc == 0 and not absent
    if absent:
        record.note += f" no wheel in {wheels.name}/ for: {', '.join(absent)} (make gpu-wheels)"
    return record, missing


def install_peers(peers: Path, site: Path, python: str, record: Record) -> list[str]:
    """The benchmark's peers (docs/gpu.md): the wheels in `peers`, and its .tar.xz archives of installed
    packages (llama-cpp-python built with CUDA: its wheel holds each library three times over, past what a
    GPU machine is sent), into `site` beside the pinned ones; their names, or none. Not pebbling's
    dependencies: where they are absent or do not install, the benchmark records its peer absent."""
    import tarfile

    wheels = sorted(peers.glob("*.whl")) if peers.is_dir() else []
    archives = sorted(peers.glob("*.tar.xz")) if peers.is_dir() else []
    try:
        if wheels:
            done = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                                   "--no-cache-dir", "--disable-pip-version-check", "--target", str(site),
                                   *map(str, wheels)], capture_output=True, text=True, timeout=CAPS["setup"])
            if done.returncode:
                record.note += f" peers from {peers.name}/ did not install: {done.stderr[-500:]}"
                return []
        for archive in archives:
            with tarfile.open(archive) as tar:
                tar.extractall(site, filter="tar")
    except (subprocess.TimeoutExpired, OSError, tarfile.TarError) as exc:
        record.note += f" peers from {peers.name}/: {type(exc).__name__}: {exc}"
        return []
    if wheels or archives:
        record.counts = {**(record.counts or {}), "peers": len(wheels) + len(archives)}
    return [wheel_name(w.name)[0] for w in wheels] + [a.name.split("-")[0] for a in archives]


def cuda_library_dirs() -> list[str]:
    """Where the image keeps cuBLAS and the CUDA runtime (its toolkit, or the nvidia-* wheels beside torch),
    for a peer's libraries that link them."""
    found = [Path("/usr/local/cuda/lib64")]
    for entry in map(Path, sys.path):
        found += sorted((entry / "nvidia").glob("*/lib")) if (entry / "nvidia").is_dir() else []
    return [str(p) for p in found if p.is_dir() and any(p.glob("libcublas*.so*"))]


def stage_plan(args, work: Path, python: str) -> list[Stage]:
    caps = args.caps
    no_skip = ["--no-skip-gpu"] if args.backend == "cuda" else []
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rfEs", *no_skip]
    # The suite's backend-parametrized tests run on this backend alone; the others take the one pebbling
    # selects (cuda first), as they would for a user. The probe sees that choice, unless another is asked for.
    backend_env = {"PEBBLING_TEST_BACKENDS": args.backend}
    probe_env = {} if args.backend == "cuda" else {"PEBBLING_BACKEND": args.backend}
    workers = ["-n", str(args.test_workers)] if args.test_workers > 0 else []
    # the kernel tests ran in their own stage just before: the suite takes the rest
    done = [f"--ignore={t}" for t in args.kernel_tests if "kernels" in args.stages and args.tests == ["tests"]]
    bench_json = work / "bench.json"
    variants = sorted((ROOT / "build" / "variants").glob("*.so")) if args.backend == "cuda" else []  # cuda builds
    # on cuda the library also with PEBBLING_CUDA_PERSIST=0 (x staged a row group at a time)
    builds = [ROOT / "build" / f"libpebble_{args.backend}.so", *variants]
    libs = [*builds, *([f"{builds[0]}+PEBBLING_CUDA_PERSIST=0"] if args.backend == "cuda" else [])]
    return [
        Stage("probe", [python, entry("memory"), "probe", "--backend", args.backend], caps["probe"],
              probe_env),
        Stage("kernels", [*pytest, f"--junitxml={work / 'kernels.xml'}", *args.kernel_tests], caps["kernels"],
              {**backend_env, "CUDA_LAUNCH_BLOCKING": "1"}, str(work / "kernels.xml")),
        Stage("tests", [*pytest, *workers, f"--junitxml={work / 'tests.xml'}", *done, *args.tests], caps["tests"],
              backend_env, str(work / "tests.xml")),
        Stage("bench", [python, entry("speed"), "gpu", "--backend", args.backend,
                        "--json", str(bench_json), "--dir", str(work), *shlex.split(args.bench_args)], caps["bench"]),
        Stage("profile", [ncu_path() or "ncu", "--clock-control", "none", "--profile-from-start", "off", "--metrics",
                          "gpu__time_duration.sum", "--print-summary", "per-kernel", python,
                          entry("speed"), "gpu", "--backend", args.backend, "--json",
                          str(work / "profiled.json"), "--dir", str(work), *shlex.split(PROFILE_ARGS)], caps["profile"],
              {"PEBBLING_CUDA_GRAPHS": "0"}),
        Stage("matvec", [python, entry("speed"), "matvec", "--backend", args.backend,
                         "--libs", ",".join(str(lib) for lib in libs), "--json", str(work / "matvec.json"),
                         *([] if args.backend == "cuda" else ["--scale", "0.002", "--repeats", "1"])], caps["matvec"]),
    ]


def ncu_path() -> str | None:
    """Nsight Compute's command line, on PATH or where the CUDA images keep it."""
    found = shutil.which("ncu") or next(iter(sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None)
    return str(found) if found else None


_KERNEL = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Device \d+, CC [\d.]+, "
                     r"Invocations (\d+)$")
_TIME = re.compile(r"gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)\s+([\d.,]+)\s+([\d.,]+)")
_UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def read_profile(log: Path, top: int = 40) -> list[dict]:
    """The kernels of ncu's per-kernel summary in `log`, the most total time first: name, grid, block,
    invocations, mean/min/max microseconds."""
    rows, current = [], None
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        m = _KERNEL.match(line)
        if m:
            current = {"kernel": m.group(1), "grid": [int(v) for v in m.group(2, 3, 4)],
                       "block": [int(v) for v in m.group(5, 6, 7)], "invocations": int(m.group(8))}
            continue
        t = _TIME.search(line)
        if t and current and t.group(1) in _UNIT_US:
            scale = _UNIT_US[t.group(1)]
            mean, low, high = (round(float(v.replace(",", "")) * scale, 2) for v in t.group(4, 2, 3))
            rows.append({**current, "mean_us": mean, "min_us": low, "max_us": high,
                         "total_us": round(mean * current["invocations"], 1)})
            current = None
    return sorted(rows, key=lambda r: -r["total_us"])[:top]


def run_all(args, out_dir: Path) -> dict:
    began, python = time.monotonic(), sys.executable
    work = Path(tempfile.mkdtemp(prefix="pebbling-gpu-check-"))
    site = work / "site"
    setup, missing = install_missing(ROOT / ".whl", site, python)
    peers = install_peers(ROOT / ".peers", site, python, setup) if args.backend == "cuda" else []
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(site) if missing or peers else "",
                                                      os.environ.get("PYTHONPATH", "")) if p),
               LD_LIBRARY_PATH=os.pathsep.join(cuda_library_dirs() + [os.environ.get("LD_LIBRARY_PATH", "")]).strip(
                   os.pathsep))
    records = [setup]
    lib = ROOT / "build" / f"libpebble_{args.backend}.so"
    if not lib.is_file():
        if shutil.which("nvcc" if args.backend == "cuda" else "g++"):
            records.append(run_stage(Stage("build", ["make", args.backend], CAPS["build"]), out_dir, env))
        else:
            records.append(Record("build", "", 0, note=f"{lib.relative_to(ROOT)} is missing and cannot be built "
                                  "here: run `make cuda` where nvcc is and carry build/"))
    for stage in stage_plan(args, work, python):
        if stage.name not in args.stages:
            continue
        if stage.name == "profile" and (args.backend != "cuda" or not ncu_path()):
            why = "ncu was not found" if args.backend == "cuda" else "kernels are profiled on cuda only"
            records.append(Record("profile", "", 0, ok=True, note=f"not run: {why}"))  # a diagnostic, not a check
            continue
        left = args.budget_s - (time.monotonic() - began)
        later = sum(FLOOR[s] for s in args.stages if STAGES.index(s) > STAGES.index(stage.name))
        stage.timeout_s = max(min(stage.timeout_s, left - later), 0.1)
        print(f"gpu-check: {stage.name} (timeout {stage.timeout_s:.0f} s) ...", flush=True)
        records.append(run_stage(stage, out_dir, env))
        r = records[-1]
        print(f"gpu-check: {stage.name}: {'ok' if r.ok else 'FAILED'} rc={r.rc} {r.seconds:.1f} s "
              f"{_counts_text(r.counts)} {r.note}".rstrip(), flush=True)
        if stage.name == "kernels" and r.failures and args.backend == "cuda":
            left = args.budget_s - (time.monotonic() - began) - later
            pytest = [a for a in stage.argv if not a.startswith("--junitxml=") and a not in args.kernel_tests]
            r.switches = try_switches(r, pytest, {**env, **stage.env}, out_dir, min(SWITCHES_CAP, left))
            print(f"gpu-check: kernels again under each switch: {switches_text(r.switches)}", flush=True)
    result = {"ok": all(r.ok for r in records), "backend": args.backend, "budget_s": args.budget_s,
              "test_workers": args.test_workers, "bench_args": args.bench_args,
              "total_seconds": round(time.monotonic() - began, 2), "started_utc": args.started,
              "machine": {"host": platform.node(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
              "stages": [asdict(r) for r in records]}
    probe = out_dir / "probe.log"
    if probe.is_file():
        last = probe.read_text(errors="replace").strip().splitlines()[-1:]
        try:
            result["probe"] = json.loads(last[0]) if last else None
        except json.JSONDecodeError:
            result["probe"] = None
    for name in ("bench", "matvec"):
        found = work / f"{name}.json"
        result[name] = json.loads(found.read_text()) if found.is_file() else None
    result["profile"] = read_profile(out_dir / "profile.log")
    shutil.rmtree(work, ignore_errors=True)
    return result


def _counts_text(counts: dict | None) -> str:
    if not counts:
        return ""
    return ", ".join(f"{v} {k}" for k, v in counts.items() if k not in ("from",) and v)


def summary(result: dict) -> str:
    lines = [f"gpu-check on {result['machine']['host']} ({result['backend']}): "
             f"{'PASS' if result['ok'] else 'FAIL'} in {result['total_seconds']:.0f} s of {result['budget_s']:.0f}"]
    probe = result.get("probe") or {}
    gpus = (probe.get("nvml") or {}).get("gpus") or []
    if gpus:
        lines.append(f"  GPU {gpus[0]['name']}, driver {probe['nvml']['driver']}, CUDA {probe['nvml']['cuda_driver']}")
    for s in result["stages"]:
        lines.append(f"  {s['name']:8s} {'ok' if s['ok'] else 'FAIL':4s} rc={s['rc']} {s['seconds']:7.1f} s "
                     f"(timeout {s['timeout_s']:.0f}) {_counts_text(s['counts'])} {s['note'][:200]}".rstrip())
        for f in s["failures"][:15]:
            lines.append(f"      {f['kind']}: {f['test']}: {f['message'][:160]}")
        if s.get("switches"):
            lines.append(f"      the failed tests again: {switches_text(s['switches'])}")
    bench = result.get("bench")
    if bench:
        lines += ["", *bench.get("table", [])]
    if result.get("matvec"):  # speed_matvec imports gguf, which setup installs: imported only once it has run
        from lib.speed_matvec import label as bench_matvec_label, outputs_text as bench_matvec_outputs  # noqa: PLC0415

        lines.append(f"  matvec {bench_matvec_outputs(result['matvec'])}")
        for lib in result["matvec"]:
            lines.append(f"  matvec {bench_matvec_label(lib)}: a Llama-3-8B Q4_K_M token's products (measured calls x "
                         "calls) " + ", ".join(f"{ms:.3f} ms at {nv} vector(s)" for nv, ms in lib.get("token_ms", {}).items())
                         + "".join(f"; kernels alone {ms:.3f} ms at {nv}" for nv, ms in lib.get("token_kernel_ms", {}).items()))
    if result.get("profile"):
        lines += ["", "decode kernels by total time (ncu, one layer and the output, batch 1, 8 steps after 512 tokens):"]
        lines += [f"  {k['total_us']:9.1f} us  {k['invocations']:4d} x {k['mean_us']:8.2f} us  {k['kernel'][:90]}"
                  for k in result["profile"][:12]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="where the JSON, the summary and the logs go")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--budget-s", type=float, default=530.0, help="the whole run's time, setup included")
    parser.add_argument("--tests", nargs="*", default=["tests"])
    parser.add_argument("--kernel-tests", nargs="*", default=KERNEL_TESTS)
    parser.add_argument("--test-workers", type=int, default=-1,
                        help="pytest-xdist processes for the suite; 0: one process; default: 4 on cuda where "
                             "pytest-xdist imports, else 0")
    parser.add_argument("--bench-args", default=DEFAULT_BENCH_ARGS)
    parser.add_argument("--cap", action="append", default=[], metavar="STAGE=SECONDS",
                        help="a stage's own timeout, over the default")
    args = parser.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        parser.error(f"--stages: {', '.join(unknown)} unknown; choose from {', '.join(STAGES)}")
    if args.test_workers < 0:
        args.test_workers = 4 if args.backend == "cuda" and importlib.util.find_spec("xdist") else 0
    args.caps = dict(CAPS)
    for cap in args.cap:
        name, _, seconds = cap.partition("=")
        if name not in CAPS:
            parser.error(f"--cap {cap}: no stage {name!r}")
        args.caps[name] = float(seconds)
    args.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = run_all(args, out_dir)
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1))
    text = summary(result)
    (out_dir / "summary.txt").write_text(text)
    print(text, end="")
    return 0 if result["ok"] else 1


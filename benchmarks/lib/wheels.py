"""Downloads the wheels a GPU machine with no package registry needs (benchmarks/gpu_requirements.txt) into
.whl/, checks that every pin has exactly one wheel, and prints their size beside what travels to that
machine in all (the tracked tree, .whl/ and build/), which must stay within its 64 MiB.

    python benchmarks/gpu_check.py wheels [--dest .whl] [--check-only]     (make gpu-wheels)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from lib import BENCHMARKS, ROOT

PINS = BENCHMARKS / "gpu_requirements.txt"
PYTHON_VERSION = "3.12"          # the GPU image's interpreter
# pip matches a manylinux_2_N tag exactly, so every glibc level a wheel might be tagged with is named
# (the GPU image's glibc is newer than all of them).
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64"
                                                             for n in (5, 17, 24, 27, 28, 31, 34, 35)]
TRAVEL_LIMIT = 64 * 2**20        # what one call to the GPU machine may carry, everything together
WHEELS_LIMIT = 40 * 2**20        # the wheels' share of it: the tree and build/ need the rest


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = PINS) -> dict[str, str]:
    """name (normalized) -> exact version, from `name==version` lines; comments and blanks ignored.
    Anything but an exact pin, or a name given twice, is an error naming the line."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if not match:
            raise ValueError(f"{path.name}:{number}: {line!r} is not an exact pin (name==version)")
        name = normalize(match.group(1))
        if name in pins:
            raise ValueError(f"{path.name}:{number}: {name} is pinned twice")
        pins[name] = match.group(2)
    return pins


def wheel_name(filename: str) -> tuple[str, str]:
    """(normalized distribution name, version) of a wheel's file name."""
    parts = filename[:-len(".whl")].split("-")
    return normalize(parts[0]), parts[1]


def check_wheels(dest: Path, pins: dict[str, str]) -> list[str]:
    """What is wrong with dest's wheels against the pins: missing, extra, or another version."""
    found: dict[str, list[str]] = {}
    for wheel in sorted(dest.glob("*.whl")):
        name, version = wheel_name(wheel.name)
        found.setdefault(name, []).append(version)
    problems = [f"{name}=={version}: no wheel" for name, version in pins.items() if name not in found]
    for name, versions in found.items():
        if name not in pins:
            problems.append(f"{name} {versions}: not in {PINS.name} (remove it: --no-deps installs every wheel)")
        elif versions != [pins[name]]:
            problems.append(f"{name}: wheels of {versions}, pinned {pins[name]}")
    return problems


def tree_bytes() -> int:
    """Bytes of the files git tracks or would add (what travels besides carried folders)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed
               if name and (ROOT / name.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def download(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):
        stale.unlink()
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--implementation", "cp", "-r", str(PINS), "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    parser.add_argument("--check-only", action="store_true", help="check what is there, download nothing")
    args = parser.parse_args(argv)
    dest, pins = Path(args.dest), read_pins()
    if not args.check_only:
        download(dest)
    problems = check_wheels(dest, pins)
    wheels, build, tree = folder_bytes(dest), folder_bytes(ROOT / "build"), tree_bytes()
    total = wheels + build + tree
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(f"{len(list(dest.glob('*.whl')))} wheels for {len(pins)} pins in {dest}: {mib(wheels)} "
          f"(limit {mib(WHEELS_LIMIT)})")
    print(f"travels with carry=['build', '.whl']: tree {mib(tree)} + build/ {mib(build)} + wheels {mib(wheels)} "
          f"= {mib(total)} of {mib(TRAVEL_LIMIT)}")
    peers = folder_bytes(ROOT / ".peers")
    if peers:  # the benchmark's peers (docs/gpu.md), sent beside the two libraries, not all of build/
        libraries = sum(p.stat().st_size for name in ("libpebble_cuda.so", "libpebble_host.so")
                        if (p := ROOT / "build" / name).is_file())
        with_peers = tree + libraries + wheels + peers
        over = " (over: send the peers in a call of their own)" if with_peers > TRAVEL_LIMIT else ""
        print(f"with carry=['build/libpebble_cuda.so', 'build/libpebble_host.so', '.whl', '.peers']: "
              f"{mib(with_peers)} of {mib(TRAVEL_LIMIT)}{over}")
    if wheels > WHEELS_LIMIT:
        problems.append(f"the wheels take {mib(wheels)}, over their {mib(WHEELS_LIMIT)}")
    if total > TRAVEL_LIMIT:
        problems.append(f"{mib(total)} would travel, over {mib(TRAVEL_LIMIT)}: carry less (make clean; make cuda)")
    for problem in problems:
        print(f"gpu-wheels: {problem}", file=sys.stderr)
    return 1 if problems else 0


"""The package as pip builds it: `pip wheel .` compiles the host library with scikit-build-core from the
Makefile's sources and flags, and the wheel carries it (inside pyplugin/, where the bindings look), the
ABI header, the web page's files and the LICENSE; installed on its own, it chooses the host backend."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def makefile_variable(name: str) -> list[str]:
    """A `NAME := ...` variable of the Makefile as words, with $(OTHER) references expanded."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name}\s*:?=\s*(.*)$", text, re.M)
    assert match, f"the Makefile has no {name}"
    words = []
    for word in match.group(1).split():
        ref = re.fullmatch(r"\$\((\w+)\)", word)
        words += makefile_variable(ref.group(1)) if ref else [word]
    return words


def test_cmake_compiles_the_makefiles_host_sources():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for source in makefile_variable("HOST_SRC"):
        assert source in cmake, f"CMakeLists.txt does not build {source}, which the Makefile's host target does"


def test_auto_builds_the_cuda_library_only_where_it_can_run_and_says_so(tmp_path):
    """pip install's default (PEBBLING_CUDA=AUTO) builds the CUDA library only where nvcc and an NVIDIA driver
    are both here: on a machine with nvcc and no driver it once spent 4.5 minutes on a library nothing could
    load. A configure (no build) says which it does, and that the host library is built."""
    if not shutil.which("cmake"):
        pytest.skip("cmake is not on PATH (scikit-build-core needs it to build the native library)")
    done = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path), "-DPEBBLING_CUDA=AUTO"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    said = done.stdout
    assert "pebbling: building the host library" in said
    driver, nvcc = Path("/proc/driver/nvidia/version").exists(), shutil.which("nvcc")
    if not driver:
        assert "building the CUDA library" not in said
        assert ("nvcc is here but no NVIDIA driver" if nvcc else "no NVIDIA driver and no nvcc here") in said
    elif nvcc:
        assert "pebbling: building the CUDA library too" in said


def cmake_list(name: str) -> list[str]:
    """A `set(NAME ...)` list of CMakeLists.txt as words."""
    match = re.search(rf"^set\({name}\s+([^)]*)\)", (ROOT / "CMakeLists.txt").read_text(), re.M)
    assert match, f"CMakeLists.txt sets no {name}"
    return match.group(1).split()


def test_every_native_source_is_built_by_both_build_files():
    """Each .cu under native/ goes into both libraries and each .cc into the host library alone, in the
    Makefile and in CMake alike: a source added to native/ and left out of a list fails here, not at link
    time on another machine."""
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "native").rglob("*") if p.suffix in (".cu", ".cc"))
    cuda = [s for s in sources if s.endswith(".cu")]
    assert sorted(makefile_variable("NATIVE_SRC")) == cuda
    assert sorted(makefile_variable("HOST_SRC")) == sources
    assert sorted(cmake_list("PEBBLING_NATIVE_SRC")) == cuda
    assert sorted(cmake_list("PEBBLING_NATIVE_SRC") + cmake_list("PEBBLING_CPU_SRC")) == sources


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from this checkout, host library only (the CUDA one is the same CMake file with
    nvcc, and takes minutes), in a build directory of its own so that it really compiles."""
    if not shutil.which("cmake"):
        pytest.skip("cmake is not on PATH (scikit-build-core needs it to build the native library)")
    out = tmp_path_factory.mktemp("wheel")
    build_dir = tmp_path_factory.mktemp("cmake-build")
    command = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
               "--quiet", "-w", str(out), "-C", "cmake.define.PEBBLING_CUDA=OFF",
               "-C", "cmake.define.CMAKE_EXPORT_COMPILE_COMMANDS=ON", "-C", f"build-dir={build_dir}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (found,) = out.glob("pebbling-*.whl")
    found.with_suffix(".build").write_text(str(build_dir))
    return found


@pytest.mark.slow
@pytest.mark.ci  # the wheel compiles the host library from source (40 s)
def test_wheel_carries_host_library_header_and_license(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "pyplugin/libpebble_host.so" in names
        assert "pyplugin/store/pebble.h" in names  # the bindings read the ABI from it
        assert archive.read("pyplugin/store/pebble.h") == (ROOT / "native" / "pebble.h").read_bytes()
        for page in (ROOT / "server_patch" / "web").iterdir():  # the web page, served from the package
            assert f"server_patch/web/{page.name}" in names, page.name
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        license_text = archive.read(license_name).decode()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_name).decode()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert "Copyright 2026 the pebbling authors" in license_text
    assert "License-Expression: Apache-2.0" in metadata
    assert not any(name.endswith(".pyc") or "__pycache__" in name for name in names)
    assert not any(name.startswith(("tests/", "build/", "native/")) for name in names)


@pytest.mark.slow
@pytest.mark.ci  # the wheel compiles the host library from source (40 s)
def test_wheel_compiles_with_the_makefiles_host_flags(wheel):
    build_dir = Path(wheel.with_suffix(".build").read_text())
    commands = json.loads((build_dir / "compile_commands.json").read_text())
    wanted = set(makefile_variable("HOST_FLAGS")) - {"-shared", "-x", "c++"}  # -shared: a link flag
    compiled = {Path(entry["file"]).name for entry in commands}
    assert compiled == {Path(s).name for s in makefile_variable("HOST_SRC")}
    for entry in commands:
        flags = set(shlex.split(entry["command"]))
        assert wanted <= flags, f"{entry['file']}: missing {sorted(wanted - flags)}"
        assert "-O3" in flags and "-DNDEBUG" not in flags
        if entry["file"].endswith(".cu"):
            assert "-xc++" in flags or "-x" in flags  # .cu read as C++, not handed to the linker


@pytest.mark.slow
@pytest.mark.ci  # the wheel compiles the host library from source (40 s)
def test_installed_wheel_uses_its_own_host_library(wheel, tmp_path):
    """The wheel installed into a directory of its own, run with this environment's dependencies but
    not its editable checkout (-S: no .pth files), chooses the host backend from the library it carries."""
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PEBBLING_LIB", "PEBBLING_BACKEND")}
    # dependencies installed into a folder on PYTHONPATH (as on a machine without a registry) stay found;
    # the checkout does not
    deps = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"],
                                         sysconfig.get_paths()["platlib"], *deps])
    done = subprocess.run([sys.executable, "-S", "-m", "pyplugin.cli", "info"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "backend: host" in done.stdout
    assert f"library: {target / 'pyplugin' / 'libpebble_host.so'}" in done.stdout

"""The architecture as the tree shows it: layers that import downward only, no import cycle, the
server on the serving layer's public names, backend names only where backends are defined, and no
module grown past what one reader takes in; and the native library's layout: a file per operation on
each side, none past 800 lines, each opening with what it computes, each side including only what its
place allows.

Imports are read from the source (every import statement, those inside functions too), so a lazy
import that points the wrong way counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pyplugin", "server_patch")

# Rank of each part of pyplugin: a module may import its own part and the parts ranked below it.
LEAVES = {"pyplugin", "pyplugin.errors", "pyplugin.ggml_types", "pyplugin.kv_types", "pyplugin.xp"}
RANKS = {"leaf": 0, "model": 1, "store": 2, "runtime": 3, "serving": 4, "commands": 5, "server_patch": 6}
MAX_LINES = 400
LONGER_ALLOWED = {"pyplugin/store/stub.py"}  # the reference semantics of native/pebble.h, in one place
BACKEND_MODULES = {"pyplugin/store/backend.py", "pyplugin/store/native.py"}  # where backends are defined


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def part(module: str) -> str:
    if module.startswith("server_patch"):
        return "server_patch"
    if module in LEAVES:
        return "leaf"
    if module == "pyplugin.cli":
        return "commands"
    return module.split(".")[1]


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in `module` of our packages."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [alias.name for alias in node.names]
            # `from . import gpu` imports the submodule itself
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            found += [(sub, [], node.lineno) for sub in subs] or [(base, names, node.lineno)]
    return [(target, names, line) for target, names, line in found if target.split(".")[0] in PACKAGES]


def edges() -> dict[str, set[str]]:
    graph = {}
    for module in MODULES:
        graph[module] = set()
        for target, _, _ in imports(module):
            while target not in MODULES and "." in target:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            graph[module].add(target)
    return graph


def test_every_import_points_down_or_stays_in_its_part():
    wrong = []
    for module in MODULES:
        for target, _, line in imports(module):
            mine, theirs = part(module), part(target)
            if theirs != mine and RANKS[theirs] > RANKS[mine]:
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_the_model_imports_nothing_of_the_store_runtime_or_serving():
    model = [m for m in MODULES if part(m) == "model"]
    assert model, "pyplugin.model has moved: update this test"
    reached = {target for m in model for target, _, _ in imports(m)}
    assert {part(t) for t in reached} <= {"leaf", "model"}, sorted(reached)


def test_importing_the_model_loads_no_store_in_a_fresh_interpreter():
    code = ("import sys, pyplugin.model.transformer, pyplugin.model.load; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('pyplugin.'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    assert loaded and {part(m) for m in loaded} <= {"leaf", "model"}, loaded


def test_there_is_no_import_cycle():
    graph, state, cycles = edges(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # A package importing its own submodules is how __init__ re-exports; a cycle goes back up.
    real = [c for c in cycles if not all(a.startswith(b + ".") for a, b in zip(c[1:], c[:-1]))]
    assert not real, "import cycles:\n" + "\n".join(" -> ".join(c) for c in real)


def test_the_server_uses_only_the_serving_layers_public_names():
    import pyplugin.serving

    public = set(pyplugin.serving.__all__)
    wrong = []
    for module in (m for m in MODULES if part(m) == "server_patch"):
        for target, names, line in imports(module):
            if target.startswith("pyplugin") and (target != "pyplugin.serving" or not set(names) <= public):
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {target} {names}")
    assert not wrong, "\n".join(wrong)


def source_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of code with comments and docstrings' text left out (a backend named in prose is fine)."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return [(n, line.split("#")[0]) for n, line in enumerate(text.splitlines(), 1) if n not in docstrings]


@pytest.mark.parametrize("pattern,allowed", [
    (r'"cuda"', BACKEND_MODULES),            # callers ask the backend object, never compare its name
    (r"\bxp is not np\b", {"pyplugin/xp.py"}),  # numpy and CuPy meet in one module
])
def test_backend_differences_live_with_the_backends(pattern, allowed):
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in MODULES.values() if str(path.relative_to(ROOT)) not in allowed
             for n, line in source_lines(path) if re.search(pattern, line)]
    assert not found, "\n".join(found)


def test_no_module_is_longer_than_one_reader_takes_in():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= LONGER_ALLOWED, long


# ---------------------------------------------------------------------------------------------------
# the native library (DESIGN.md, "Layout"): pebble.h (the one ABI source), the store and what every part
# shares at the top of native/; under cuda/ one file per operation with its kernels and their launcher,
# compiled for the GPU by nvcc and as C++ into the host library; under cpu/ the host library's own CPU
# kernels, one file per operation. Includes are read from the text, preprocessor conditions included.

NATIVE = ROOT / "native"
MAX_NATIVE_LINES = 800
NATIVE_SUFFIXES = {"": {".h", ".cu"}, "cpu": {".h", ".cc"}, "cuda": {".cuh", ".cu"}}  # per directory


def native_files() -> list[Path]:
    return sorted(p for p in NATIVE.rglob("*") if p.is_file())


def side(path: Path) -> str:
    """'cpu', 'cuda', or '' for the top of native/."""
    parts = path.relative_to(NATIVE).parts
    return parts[0] if len(parts) > 1 else ""


def native_includes(path: Path) -> list[tuple[int, str, bool]]:
    """(line, the quoted header as written, whether it is included only in the host build: inside
    `#ifdef PEBBLE_HOST_BUILD`) for each `#include "..."` of a native file."""
    found, conditions = [], []  # the enclosing #if conditions, innermost last
    for n, line in enumerate(path.read_text().splitlines(), 1):
        directive = re.match(r"\s*#\s*(\w+)\s*(.*?)\s*(//.*)?$", line)
        if not directive:
            continue
        word, rest = directive.group(1), directive.group(2)
        if word in ("if", "ifdef", "ifndef"):
            conditions.append(f"{word} {rest}")
        elif word in ("else", "elif"):
            conditions[-1] = f"{word} {rest}"
        elif word == "endif":
            conditions.pop()
        elif word == "include" and rest.startswith('"'):
            found.append((n, rest.strip('"'), "ifdef PEBBLE_HOST_BUILD" in conditions))
    return found


NATIVE_INCLUDES = {p: native_includes(p) for p in native_files()}


def include_violations(rule) -> list[str]:
    """Every include for which rule(including file, included name, host build only) is false."""
    return [f"{p.relative_to(ROOT)}:{n}: #include \"{name}\"" + (" (host build only)" if host else "")
            for p, found in NATIVE_INCLUDES.items() for n, name, host in found if not rule(p, name, host)]


def test_native_files_are_the_kinds_of_their_directory():
    wrong = [str(p.relative_to(ROOT)) for p in native_files()
             if side(p) not in NATIVE_SUFFIXES or p.suffix not in NATIVE_SUFFIXES[side(p)]]
    assert not wrong, f"native/ holds .h and .cu, native/cpu/ .h and .cc, native/cuda/ .cuh and .cu: {wrong}"


def test_no_native_file_is_longer_than_one_reader_takes_in():
    long = {str(p.relative_to(ROOT)): n for p in native_files()
            if (n := len(p.read_text().splitlines())) > MAX_NATIVE_LINES}
    assert not long, f"native files past {MAX_NATIVE_LINES} lines: {long}"


def test_every_native_file_opens_with_what_it_computes():
    """Line 1 names the file as it lies under native/ and says what it holds: `// cuda/norm.cu: RMS norms ...`."""
    wrong = []
    for p in native_files():
        first = p.read_text().splitlines()[0] if p.read_text() else ""
        name = p.relative_to(NATIVE).as_posix()
        if not re.fullmatch(rf"// {re.escape(name)}: \S.{{20,}}", first):
            wrong.append(f"{p.relative_to(ROOT)}: {first!r}")
    assert not wrong, "\n".join(wrong)


def test_every_include_names_a_native_header_from_native():
    """Includes are written from native/ (the builds pass -Inative), so the rules below read the real graph;
    and a source is compiled on its own, never included."""
    wrong = include_violations(lambda p, name, host: (NATIVE / name).is_file() and Path(name).suffix in (".h", ".cuh"))
    assert not wrong, "\n".join(wrong)


def test_the_abi_header_stands_alone():
    assert not NATIVE_INCLUDES[NATIVE / "pebble.h"], "pebble.h includes no header of the library"


def test_the_top_of_native_includes_nothing_of_either_side():
    """The store, the ABI and the headers every part shares know no kernel: nothing of cpu/ or cuda/."""
    wrong = include_violations(lambda p, name, host: side(p) != "" or "/" not in name)
    assert not wrong, "\n".join(wrong)


def test_the_cpu_side_includes_nothing_of_the_cuda_side():
    wrong = include_violations(lambda p, name, host: side(p) != "cpu" or not name.startswith("cuda/"))
    assert not wrong, "\n".join(wrong)


def test_the_cuda_side_reaches_the_cpu_side_through_its_interface_in_the_host_build_only():
    """The host build's launchers hand work to the CPU kernels through cpu/cpu.h alone, and only there: the
    GPU's build of the same source includes nothing of cpu/."""
    wrong = include_violations(lambda p, name, host: side(p) != "cuda" or not name.startswith("cpu/")
                               or (name == "cpu/cpu.h" and host))
    assert not wrong, "\n".join(wrong)

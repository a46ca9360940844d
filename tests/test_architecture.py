"""The architecture as the tree shows it: layers that import downward only, no import cycle, the
server on the serving layer's public names, backend names only where backends are defined, and no
module grown past what one reader takes in.

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

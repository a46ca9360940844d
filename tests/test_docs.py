"""The documentation held to the code.

- Every environment variable that pyplugin/, server_patch/, native/ and the Makefile read is documented in
  docs/ (a name the scanner finds but cannot resolve, such as `os.environ.get(some_call())`, fails too, so a
  new read cannot slip past it), and so is every build setting native/ takes by `-D`.
- Every relative link in README.md and docs/*.md reaches a file, and an #anchor a heading of it; every file
  of the tree they name (`pyplugin/...`, `benchmarks/...`) exists.
- Every command in the code blocks of README.md and docs/*.md exists: `make` targets in the Makefile,
  `pebbling` subcommands in the CLI's parser, `benchmarks/*.py` scripts in the tree, the paths `curl`
  calls among the server's routes; a Python block parses.
- The README stays under 200 lines, and its first code block holds the two set-up commands.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def docs_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


# ---------------------------------------------------------------------------------------------------
# environment variables: what the code reads


class _Unresolved(Exception):
    """An environment read whose variable name the scanner cannot work out."""


def _python_modules() -> dict[Path, ast.Module]:
    files = [f for d in ("pyplugin", "server_patch") for f in sorted((ROOT / d).rglob("*.py"))]
    return {f: ast.parse(f.read_text(), filename=str(f)) for f in files}


def _with_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]


def _ancestors(node: ast.AST):
    while (node := getattr(node, "parent", None)) is not None:
        yield node


def _strings(node: ast.AST, constants: dict[str, set[str]]) -> set[str] | None:
    """The strings a constant expression stands for: a literal, a tuple, list or set of them, a dict's keys,
    or a name bound to one of those at module or class level (of any module: names are imported freely)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) or isinstance(node, ast.Dict):
        elements = node.keys if isinstance(node, ast.Dict) else node.elts
        found: set[str] = set()
        for element in elements:
            part = None if element is None else _strings(element, constants)
            if part is None:
                return None
            found |= part
        return found
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _module_constants(modules: dict[Path, ast.Module]) -> dict[str, set[str]]:
    """Every module- or class-level name bound to constant strings (`REGISTRY_ENV = "PEBBLING_REGISTRY"`,
    `A_ENV, B_ENV = ("X", "Y")`, `KV_ENV = ("X", "Y")`, `SWITCHES = {"X": ...}`), to a fixed point so that a
    tuple of such names resolves too."""
    constants: dict[str, set[str]] = {}
    changed = True
    while changed:
        changed = False
        for tree in modules.values():
            bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
            for statement in (s for body in bodies for s in body):
                if isinstance(statement, ast.AnnAssign) and statement.value is not None:
                    pairs = [(statement.target, statement.value)]
                elif isinstance(statement, ast.Assign):
                    pairs = [(t, statement.value) for t in statement.targets]
                else:
                    continue
                for target, value in pairs:
                    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                            and len(target.elts) == len(value.elts):
                        pairs += list(zip(target.elts, value.elts))
                        continue
                    if not isinstance(target, ast.Name):
                        continue
                    strings = _strings(value, constants)
                    if strings and not strings <= constants.get(target.id, set()):
                        constants[target.id] = constants.get(target.id, set()) | strings
                        changed = True
    return constants


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "environ") or \
        (isinstance(node, ast.Attribute) and node.attr == "environ")


def _environ_reads(tree: ast.Module):
    """The expressions naming the variable of each read of the environment in a module: os.environ.get(X),
    .setdefault(X, ...), .pop(X), os.environ[X] (not as an assignment's target), X in os.environ,
    os.getenv(X); `environ` may be a parameter that is handed os.environ."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") \
                    and _is_environ(func.value):
                yield node.args[0]
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or \
                    (isinstance(func, ast.Name) and func.id == "getenv"):
                yield node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            yield node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            yield node.left


class _Scanner:
    def __init__(self):
        self.modules = _python_modules()
        for tree in self.modules.values():
            _with_parents(tree)
        self.constants = _module_constants(self.modules)
        self.calls = [n for tree in self.modules.values() for n in ast.walk(tree) if isinstance(n, ast.Call)]

    def names(self) -> tuple[set[str], list[str]]:
        """The variables read, and the reads whose variable could not be worked out (file:line)."""
        found: set[str] = set()
        unresolved: list[str] = []
        for path, tree in self.modules.items():
            for expression in _environ_reads(tree):
                try:
                    found |= self.resolve(expression, depth=0)
                except _Unresolved as exc:
                    unresolved.append(f"{path.relative_to(ROOT)}:{expression.lineno}: {exc}")
        return found, unresolved

    def resolve(self, node: ast.AST, depth: int) -> set[str]:
        if depth > 6:
            raise _Unresolved("too many steps from the read to a constant")
        strings = _strings(node, self.constants)
        if strings is not None:
            return strings
        if isinstance(node, ast.Name):
            return self._binding(node, depth)
        raise _Unresolved(f"{ast.unparse(node)} is not a constant, a name bound to one, a loop over them or a "
                          "parameter given them")

    def _binding(self, name: ast.Name, depth: int) -> set[str]:
        """Where a local name takes its value: a loop (or comprehension) over constants, including a
        dict's .items()/.keys(); an assignment in the function; a parameter, from every call that passes it."""
        for scope in _ancestors(name):
            loops = [scope] if isinstance(scope, ast.For) else \
                scope.generators if isinstance(scope, (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)) \
                else []
            for loop in loops:
                value = self._loop_value(loop.target, loop.iter, name.id, depth)
                if value is not None:
                    return value
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not isinstance(scope, ast.Lambda):
                    for statement in ast.walk(scope):
                        if isinstance(statement, ast.Assign) and any(
                                isinstance(t, ast.Name) and t.id == name.id for t in statement.targets):
                            return self.resolve(statement.value, depth + 1)
                parameters = [a.arg for a in scope.args.posonlyargs + scope.args.args]
                if name.id in parameters and not isinstance(scope, ast.Lambda):
                    return self._from_callers(scope.name, parameters.index(name.id), name.id, depth)
        raise _Unresolved(f"cannot tell what {name.id!r} holds")

    def _loop_value(self, target: ast.AST, iterable: ast.AST, wanted: str, depth: int) -> set[str] | None:
        if isinstance(target, ast.Name) and target.id == wanted:
            if isinstance(iterable, (ast.Tuple, ast.List)):
                return set().union(*(self.resolve(e, depth + 1) for e in iterable.elts))
            return self.resolve(iterable, depth + 1)
        # for key, value in CONSTANT.items(): the key
        if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name) \
                and target.elts[0].id == wanted and isinstance(iterable, ast.Call) \
                and isinstance(iterable.func, ast.Attribute) and iterable.func.attr in ("items", "keys"):
            return self.resolve(iterable.func.value, depth + 1)
        return None

    def _from_callers(self, function: str, index: int, parameter: str, depth: int) -> set[str]:
        found: set[str] = set()
        callers = [c for c in self.calls if (isinstance(c.func, ast.Name) and c.func.id == function)
                   or (isinstance(c.func, ast.Attribute) and c.func.attr == function)]
        for call in callers:
            given = [k.value for k in call.keywords if k.arg == parameter] or call.args[index:index + 1]
            if not given:
                raise _Unresolved(f"a call of {function}() at line {call.lineno} does not pass {parameter!r}")
            if _is_environ(given[0]):  # check_switches(os.environ): the environment itself, not a name
                continue
            found |= self.resolve(given[0], depth + 1)
        if not callers:
            raise _Unresolved(f"{parameter!r} is a parameter of {function}(), which nothing here calls")
        return found


def _native_sources() -> list[Path]:
    return sorted(p for p in (ROOT / "native").rglob("*") if p.suffix in (".c", ".cc", ".cpp", ".cu", ".h", ".cuh"))


def native_reads() -> set[str]:
    """getenv("NAME") in native/; a getenv of a variable (a helper handed names) counts every upper-case
    literal its file passes as a call's first argument (`is("PEBBLING_CUDA_MATVEC", "float")`)."""
    found: set[str] = set()
    for path in _native_sources():
        text = path.read_text(errors="replace")
        found |= set(re.findall(r'\bgetenv\(\s*"(\w+)"\s*\)', text))
        if re.search(r'\bgetenv\(\s*[A-Za-z_]\w*\s*\)', text):
            found |= set(re.findall(r'\b\w+\(\s*"([A-Z][A-Z0-9]*_[A-Z0-9_]+)"', text))
    return found


MAKE_BUILTINS = {"MAKE", "MAKEFLAGS", "CURDIR", "SHELL", "MAKECMDGOALS"}


def makefile_reads() -> set[str]:
    """The Makefile's variables that the environment (or the command line) may set: those it assigns
    with ?=, and those it uses without assigning (such as make's CC)."""
    text = (ROOT / "Makefile").read_text()
    assigned = set(re.findall(r"^([A-Za-z_]\w*)\s*(?::=|\+=|=)", text, re.M))
    optional = set(re.findall(r"^([A-Za-z_]\w*)\s*\?=", text, re.M))
    used = set(re.findall(r"\$[({]([A-Z_][A-Z0-9_]*)[)}]", text))  # lower-case: a foreach loop's own
    return optional | (used - assigned - optional - MAKE_BUILTINS)


def build_settings() -> set[str]:
    """The compile-time settings native/ takes by -D: `#ifndef PEBBLE_X` followed by `#define PEBBLE_X`."""
    found: set[str] = set()
    for path in _native_sources():
        text = path.read_text(errors="replace")
        found |= set(re.findall(r"#\s*ifndef\s+(PEBBLE_\w+)[^\n]*\n\s*#\s*define\s+\1\b", text))
    return found


def python_literal_names() -> set[str]:
    """Every string literal in pyplugin/ and server_patch/ that is a PEBBLING_* or OLLAMA_* name: the
    net under the scanner, since those prefixes are the environment's (the ABI's names are PEBBLE_*)."""
    return {n.value for tree in _python_modules().values() for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"(PEBBLING|OLLAMA)_[A-Z0-9_]+", n.value)}


def documented(name: str, text: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text) is not None


def test_the_scanner_finds_variables_read_through_constants_parameters_and_loops():
    names, unresolved = _Scanner().names()
    assert not unresolved, unresolved
    # through a module constant, an imported one, a tuple of them looped over, a dict's keys, a helper's parameter
    for name in ("PEBBLING_PULL_DEADLINE", "PEBBLING_REGISTRY", "PEBBLING_KV_CACHE_TYPE", "OLLAMA_KV_CACHE_TYPE",
                 "PEBBLING_MODELS", "PEBBLING_HOST", "PEBBLING_MAX_QUEUE", "OLLAMA_NUM_PARALLEL",
                 "PEBBLING_CUDA_STACK", "OMP_NUM_THREADS", "XDG_CACHE_HOME", "CUBLAS_WORKSPACE_CONFIG"):
        assert name in names, name
    assert {"PEBBLING_SIMD", "PEBBLING_THREADS", "PEBBLING_CUDA_GROUP", "PEBBLING_CUDA_MATVEC"} <= native_reads()
    assert {"MODELS", "HOST", "PORT", "CC"} <= makefile_reads()
    assert "PEBBLE_MATVEC_ROWS" in build_settings()


def test_a_read_the_scanner_cannot_follow_is_reported_not_skipped():
    scanner = _Scanner()
    tree = ast.parse("import os\ndef f(x):\n    return os.environ.get(x.name)\n")
    _with_parents(tree)
    (expression,) = list(_environ_reads(tree))
    with pytest.raises(_Unresolved):
        scanner.resolve(expression, depth=0)
    tree = ast.parse("import os\nNEW_ENV = 'PEBBLING_SOMETHING_NEW'\nvalue = os.getenv(NEW_ENV)\n")
    scanner.constants.update(_module_constants({Path("new.py"): tree}))
    _with_parents(tree)
    (expression,) = list(_environ_reads(tree))
    assert scanner.resolve(expression, depth=0) == {"PEBBLING_SOMETHING_NEW"}
    assert not documented("PEBBLING_SOMETHING_NEW", docs_text())


def test_every_environment_variable_the_code_reads_is_documented_in_docs():
    names, unresolved = _Scanner().names()
    assert not unresolved, f"environment reads whose variable the scanner cannot name: {unresolved}"
    names |= native_reads() | python_literal_names()
    text = docs_text()
    missing = sorted(n for n in names if not documented(n, text))
    assert not missing, f"read by the code but not documented in docs/ (docs/environment.md): {missing}"


def test_every_make_variable_and_build_setting_is_documented_in_docs():
    text = docs_text()
    missing = sorted(n for n in makefile_reads() | build_settings() if not documented(n, text))
    assert not missing, f"Makefile variables or native -D settings not documented in docs/: {missing}"


# ---------------------------------------------------------------------------------------------------
# links


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_its_heading(document):
    broken = []
    for target in links(document):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (document.parent / file_part).resolve() if file_part else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    assert not broken, f"{document.relative_to(ROOT)}: {broken}"


SOURCE_PATH = re.compile(r"(?<![\w/.-])(?:\.\./)?"
                         r"((?:pyplugin|server_patch|native|tests|benchmarks)/[\w./-]*\w\.[a-z]+)")


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_of_the_tree_a_document_names_exists(document):
    """`pyplugin/serving/pull.py`, `benchmarks/memory.py`, ...: in prose, tables and code blocks alike (a
    script that was renamed is named without its directory, as it was called then)."""
    missing = sorted({p for p in SOURCE_PATH.findall(document.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{document.relative_to(ROOT)} names files the tree does not hold: {missing}"


def test_the_docs_directory_holds_the_reference():
    for name in ("README.md", "api.md", "strategies.md", "environment.md", "architecture.md", "benchmarks.md",
                 "cli.md"):
        assert (DOCS / name).is_file(), name
    linked = {Path(t.partition("#")[0]).name for t in links(README) if t.startswith("docs/")}
    assert {"api.md", "strategies.md", "environment.md", "architecture.md", "benchmarks.md"} <= linked


# ---------------------------------------------------------------------------------------------------
# commands


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.M | re.S)


def commands(path: Path) -> list[str]:
    """The shell lines of a document's sh/bash/console blocks, continuation lines joined, comments cut."""
    lines = []
    for language, block in code_blocks(path):
        if language not in ("sh", "bash", "shell", "console"):
            continue
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"^\$\s+", "", line.strip())
            line = re.sub(r"(^|\s+)#(\s.*)?$", "", line)  # a comment (the JSON in these blocks holds no " # ")
            if line:
                lines.append(line)
    return lines


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))


def cli_commands() -> set[str]:
    import argparse

    from pyplugin.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def app_routes() -> list:
    from pyplugin.serving import Engine
    from server_patch.app import create_app

    def flat(routes):
        for route in routes:
            if getattr(route, "path", None) is not None:
                yield route
            else:  # a router included into another
                yield from flat(getattr(getattr(route, "original_router", None), "routes", None)
                                or getattr(route, "routes", []))

    engine = Engine(ROOT / "tests")  # no model is loaded: only the routes are read
    try:
        return list(flat(create_app(engine).routes))
    finally:
        engine.close()


def routed(routes, method: str, path: str) -> bool:
    from starlette.routing import Match

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": []}
    return any(route.matches(scope)[0] == Match.FULL for route in routes)


def _curl(line: str) -> tuple[str, str]:
    url = re.search(r"https?://[^/\s'\"]+(/[^\s'\"?]*)?", line)
    method = re.search(r"(?:-X|--request)\s+(\w+)", line)
    data = re.search(r"(?:\s-d\s|--data|-F\s|--json)", line)
    verb = method.group(1).upper() if method else "HEAD" if re.search(r"\s(-I|--head)\b", line) \
        else "POST" if data else "GET"
    return verb, (url.group(1) or "/") if url else ""


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_in_a_code_block_exists(document):
    targets, subcommands = make_targets(), cli_commands()
    routes = None
    wrong = []
    for line in commands(document):
        words = line.split()
        for i, word in enumerate(words):
            following = words[i + 1] if i + 1 < len(words) else ""
            if word == "make" and following and not following.startswith("-"):
                if "=" not in following and following not in targets:
                    wrong.append(f"`make {following}`: no such target in the Makefile")
            elif re.fullmatch(r"(\S*/)?pebbling", word) and following and not following.startswith("-"):
                if following not in subcommands:
                    wrong.append(f"`pebbling {following}`: no such subcommand ({', '.join(sorted(subcommands))})")
            elif re.fullmatch(r"benchmarks/\w+\.py", word) and not (ROOT / word).is_file():
                wrong.append(f"{word}: no such script")
        if words and words[0] == "curl":
            routes = app_routes() if routes is None else routes
            method, path = _curl(line)
            if not path or not routed(routes, method, path):
                wrong.append(f"`{line[:80]}`: the server has no {method} {path}")
    for language, block in code_blocks(document):
        if language == "python":
            try:
                ast.parse(block)
            except SyntaxError as exc:
                wrong.append(f"a Python block does not parse: {exc}")
    assert not wrong, f"{document.relative_to(ROOT)}: {wrong}"


def test_the_command_checks_catch_what_does_not_exist():
    assert "serve" in make_targets() and "test" in make_targets() and "fuzz" in make_targets()
    assert "chat" not in cli_commands() and {"run", "serve", "pull", "list", "fetch-demo"} <= cli_commands()
    routes = app_routes()
    assert routed(routes, "POST", "/api/generate") and routed(routes, "GET", "/v1/models/pebbling-demo")
    assert not routed(routes, "GET", "/api/generate") and not routed(routes, "POST", "/api/nothing")
    assert _curl("curl -s http://127.0.0.1:11435/api/chat -d '{}'") == ("POST", "/api/chat")
    assert _curl("curl http://127.0.0.1:11435/api/tags") == ("GET", "/api/tags")


# ---------------------------------------------------------------------------------------------------
# the README's shape


def test_the_readme_is_short_and_starts_with_the_two_set_up_commands():
    lines = README.read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    first = code_blocks(README)[0][1]
    setup = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert setup == ["make serve", "make test"], setup


def test_no_result_or_doc_names_a_path_of_the_machine_it_was_made_on():
    """Results record how they were run, but not where a machine keeps things: an interpreter under /tmp, a
    directory of files, a user's home (benchmarks/lib/speed_cpu.py keeps their names only)."""
    machine = re.compile(r'"/(?:tmp|root|home|work)/|(?<![\w.])/(?:tmp|root|home/\w+|work)/[\w.-]+/')
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}"
             for path in [*(ROOT / "benchmarks" / "results").rglob("*.json"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
             for match in [machine.search(path.read_text(errors="replace"))] if match]
    assert not found, found

"""benchmarks/ as a newcomer meets it: a few entry points (benchmarks/*.py), each answering one question with a
subcommand per measurement, each listed in benchmarks/README.md with its command; the code behind them in
benchmarks/lib/, where nothing runs on its own and no module is left without a subcommand."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

ENTRY_POINTS = sorted(BENCHMARKS.glob("*.py"))
MOST = 8
# lib modules that no subcommand names: what the subcommands share, and gpu_check.py's own
SHARED = {"__init__", "cli", "shapes", "serve", "gpu_model", "gpu_peers", "gpu_acceptance", "check", "wheels",
          "scale_out_ray", "hf_compare"}


def commands(entry: Path) -> dict[str, tuple[str, str]]:
    """An entry point's subcommands (its COMMANDS), or none."""
    spec = importlib.util.spec_from_file_location(f"bench_entry_{entry.stem}", entry)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "COMMANDS", {})


SUBCOMMANDS = [(entry.name, name, module) for entry in ENTRY_POINTS for name, (module, _) in commands(entry).items()]


def test_there_are_at_most_eight_entry_points():
    names = [e.name for e in ENTRY_POINTS]
    assert 0 < len(names) <= MOST, names
    assert {"speed.py", "agreement.py", "memory.py", "server.py", "scale_out.py", "gpu_check.py"} <= set(names)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda p: p.name)
def test_each_entry_point_answers_help(entry):
    """--help says what the entry point answers and lists its subcommands, importing none of them (nothing
    past the standard library: gpu_check.py's must run on a bare machine); scale_out.py's is its one command's."""
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = [{str(entry)!r}, "--help"]
        try:
            runpy.run_path({str(entry)!r}, run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        print("imported:", *sorted(m for m in ("numpy", "gguf", "pyplugin", "requests") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and ("usage:" in done.stdout or "subcommands" in done.stdout), done.stderr
    if commands(entry) or entry.name == "gpu_check.py":
        assert done.stdout.rstrip().endswith("imported:"), done.stdout[-300:]
    for name in commands(entry):
        assert re.search(rf"^  {re.escape(name)} ", done.stdout, re.M), (entry.name, name, done.stdout)


@pytest.mark.parametrize("entry, name, module", SUBCOMMANDS, ids=lambda x: str(x))
def test_each_subcommand_has_its_own_help(entry, name, module, capsys):
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_an_unknown_subcommand_is_refused_naming_the_ones_there_are():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "speed.py"), "fastest"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "no subcommand 'fastest'" in done.stderr and "cpu" in done.stderr


def test_the_readme_gives_each_entry_point_and_subcommand_a_command():
    readme = (BENCHMARKS / "README.md").read_text()
    for entry in ENTRY_POINTS:
        assert f"python benchmarks/{entry.name}" in readme, entry.name
    for entry, name, _ in SUBCOMMANDS:
        assert f"{entry} {name}" in readme, (entry, name)


def test_nothing_in_lib_runs_on_its_own_and_each_module_serves_a_subcommand():
    lib = sorted((BENCHMARKS / "lib").glob("*.py"))
    assert not [p.name for p in lib if "__main__" in p.read_text()]
    named = {module.removeprefix("lib.") for _, _, module in SUBCOMMANDS}
    assert not {p.stem for p in lib} - named - SHARED

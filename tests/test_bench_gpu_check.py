"""The GPU check's machinery (benchmarks/gpu_check.py), on a machine without a GPU: --no-skip-gpu fails a skipped
GPU test (and only a GPU test), the stage runner records rc, time and timeouts into its JSON, and the pinned
wheel list parses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from lib import check as gpu_check  # noqa: E402
from lib import wheels as gpu_wheels  # noqa: E402

PROBE_FILE = '''
import pytest
from helpers import store_backend_params

@pytest.mark.parametrize("backend", store_backend_params())
def test_on_each_backend(backend):
    pytest.skip(f"deliberately skipped on {backend}")

@pytest.mark.gpu
def test_marked_gpu():
    pytest.skip("no device here")

def test_plain():
    pytest.skip("not a GPU test")
'''


def run_pytest(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    """Runs PROBE_FILE beside copies of the suite's conftest and helpers (in tmp_path, so nothing is written
    into tests/) and returns pytest's exit code, each test's outcome from its junit report, its output."""
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs an NVIDIA GPU\n")
    (tmp_path / "test_probe.py").write_text(PROBE_FILE)
    junit = tmp_path / "junit.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py",
                           f"--junitxml={junit}", *extra], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    record = gpu_check.Record("probe", "", 0)
    gpu_check._read_pytest(record, junit, tmp_path / "none.log")
    outcomes = {f["test"].rsplit("::", 1)[1]: (f["kind"], f["message"]) for f in record.failures + record.skips}
    return done.returncode, outcomes, done.stdout + done.stderr


def test_no_skip_gpu_turns_a_skipped_gpu_test_into_a_failure_with_its_reason(tmp_path):
    rc, outcomes, out = run_pytest(tmp_path, "--no-skip-gpu")
    assert rc == 1, out
    # no GPU here: the cuda case is skipped by its mark at setup (an error), or by the test itself (a failure)
    kind, message = outcomes["test_on_each_backend[cuda]"]
    assert kind in ("failure", "error") and "skipped under --no-skip-gpu" in message, (kind, message)
    kind, message = outcomes["test_marked_gpu"]
    assert kind == "failure" and "no device here" in message
    # host and stub cases, and tests with nothing to do with a GPU, still skip
    for name in ("test_on_each_backend[host]", "test_on_each_backend[stub]", "test_plain"):
        assert outcomes[name][0] == "skipped", (name, outcomes[name])


def test_without_the_option_gpu_tests_skip_as_before(tmp_path):
    rc, outcomes, out = run_pytest(tmp_path)
    assert rc == 0, out
    assert {kind for kind, _ in outcomes.values()} == {"skipped"} and len(outcomes) == 5


def test_the_stage_runner_records_rc_time_output_and_timeouts(tmp_path):
    quick = gpu_check.Stage("fails", [sys.executable, "-c", "print('said this'); raise SystemExit(3)"], 30)
    record = gpu_check.run_stage(quick, tmp_path, {"PATH": "/usr/bin:/bin"})
    assert (record.rc, record.timed_out, record.ok) == (3, False, False)
    assert "said this" in (tmp_path / "fails.log").read_text()
    slow = gpu_check.Stage("hangs", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                           1.5)
    record = gpu_check.run_stage(slow, tmp_path, {})
    assert record.timed_out and not record.ok and record.rc is None
    assert 1.4 < record.seconds < 20 and "timed out after 2 s" in record.note
    assert "started" in (tmp_path / "hangs.log").read_text()


def test_a_timed_out_pytest_is_counted_from_its_log_and_names_the_test_it_hung_in(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text(textwrap.dedent("""\
        tests/test_a.py::test_one PASSED                                     [  1%]
        tests/test_a.py::test_two[cuda] FAILED                               [  2%]
        tests/test_a.py::test_three SKIPPED (no)                             [  3%]
        tests/test_b.py::test_hangs """))
    record = gpu_check.Record("tests", "", 1, timed_out=True)
    gpu_check._read_pytest(record, tmp_path / "missing.xml", log)
    assert {k: record.counts[k] for k in ("passed", "failed", "skipped")} == {"passed": 1, "failed": 1, "skipped": 1}
    assert record.last_test == "tests/test_b.py::test_hangs"


def test_gpu_check_on_the_host_backend_writes_one_json_and_a_summary(tmp_path):
    out = tmp_path / "out"
    rc = gpu_check.main(["--dir", str(out), "--backend", "host", "--stages", "probe,tests,bench",
                         "--tests", "tests/test_abi.py", "--cap", "probe=60",
                         "--bench-args", "--shape tiny --layers 2 --tokens 4 --prompt 8 --types Q4_K_M --peers none"])
    result = json.loads((out / "gpu_check.json").read_text())
    stages = {s["name"]: s for s in result["stages"]}
    assert list(stages) == ["setup", "probe", "tests", "bench"]
    for name in ("probe", "tests", "bench"):
        s = stages[name]
        assert s["rc"] == 0 and s["ok"] and not s["timed_out"] and s["seconds"] > 0, s
        assert (out / s["log"]).is_file()
    assert stages["tests"]["counts"]["passed"] > 0 and stages["tests"]["counts"]["failed"] == 0
    assert result["probe"]["pebbling_info"]["backend"] == "host"
    assert result["bench"]["files"][0]["rows"] and result["ok"] and rc == 0
    assert "PASS" in (out / "summary.txt").read_text()
    assert len(list(out.iterdir())) <= 8 and all(p.is_file() for p in out.iterdir())  # few files, flat


def test_a_stage_over_its_cap_is_recorded_and_the_next_still_runs(tmp_path):
    out = tmp_path / "out"
    rc = gpu_check.main(["--dir", str(out), "--backend", "host", "--stages", "probe,bench", "--cap", "probe=0.01",
                         "--bench-args", "--shape tiny --layers 2 --tokens 2 --prompt 4 --types F16 "
                                         "--batches 1 --rows none --peers none"])
    result = json.loads((out / "gpu_check.json").read_text())
    stages = {s["name"]: s for s in result["stages"]}
    assert stages["probe"]["timed_out"] and not stages["probe"]["ok"]
    assert stages["bench"]["ok"] and rc == 1 and not result["ok"]
    assert "FAIL" in (out / "summary.txt").read_text()


NCU_SUMMARY = """==PROF== Disconnected from process 1072
[1072] python3.12@127.0.0.1
  <unnamed>::add_kernel(float *, const float *, long, float) (16, 1, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 6
    Section: Command line profiler metrics
    ---------------------- ----------- ------- ------- -------
    Metric Name            Metric Unit Minimum Maximum Average
    ---------------------- ----------- ------- ------- -------
    gpu__time_duration.sum          us    2.30    2.50    2.43
    ---------------------- ----------- ------- ------- -------

  void <unnamed>::dequantize_kernel<<unnamed>::type_q4_k>(const unsigned char *, unsigned short *, long) (3584, 1, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 2
    Section: Command line profiler metrics
    ---------------------- ----------- ------- ------- -------
    Metric Name            Metric Unit Minimum Maximum Average
    ---------------------- ----------- ------- ------- -------
    gpu__time_duration.sum          ms    0.85    1.10    0.90
    ---------------------- ----------- ------- ------- -------
"""


def test_the_profile_is_read_from_ncus_summary_most_total_time_first(tmp_path):
    log = tmp_path / "profile.log"
    log.write_text(NCU_SUMMARY)
    first, second = gpu_check.read_profile(log)
    assert first["kernel"].startswith("void <unnamed>::dequantize_kernel") and first["grid"] == [3584, 1, 1]
    assert (first["invocations"], first["mean_us"], first["max_us"], first["total_us"]) == (2, 900.0, 1100.0, 1800.0)
    assert second["kernel"].startswith("<unnamed>::add_kernel") and second["block"] == [256, 1, 1]
    assert (second["mean_us"], second["total_us"]) == (2.43, 14.6)
    assert gpu_check.read_profile(tmp_path / "absent.log") == []


def test_the_profile_stage_is_recorded_as_not_run_off_cuda(tmp_path):
    out = tmp_path / "out"
    rc = gpu_check.main(["--dir", str(out), "--backend", "host", "--stages", "profile"])
    result = json.loads((out / "gpu_check.json").read_text())
    profile = [s for s in result["stages"] if s["name"] == "profile"][0]
    assert profile["ok"] and profile["note"].startswith("not run") and rc == 0 and result["profile"] == []


def test_gpu_check_starts_on_a_bare_machine_before_its_setup_installs_anything():
    """On the GPU image nothing of the project's is installed until setup has run (11-27: an import of gguf at
    the top of gpu_check.py stopped the whole check before it started): with every third-party package and
    the project's own hidden, the script still imports and parses its arguments."""
    hide = ["gguf", "numpy", "cffi", "tokenizers", "jinja2", "fastapi", "pydantic", "llguidance", "pyplugin",
            "server_patch", "cupy", "yaml"]
    code = textwrap.dedent(f"""
        import sys
        for name in {hide!r}:
            sys.modules[name] = None  # import name raises ImportError
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        sys.argv = ["gpu_check.py", "--help"]
        import gpu_check
        gpu_check.main()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--budget-s" in done.stdout


def test_the_pinned_wheel_list_parses_and_each_pin_is_exact():
    pins = gpu_wheels.read_pins()
    assert {"cffi", "gguf", "fastapi", "llguidance", "pydantic-core", "jsonschema", "pexpect"} <= set(pins)
    assert not {"numpy", "cupy-cuda13x", "torch", "transformers", "accelerate"} & set(pins)  # the image has them
    assert all(v and v[0].isdigit() for v in pins.values())


@pytest.mark.parametrize("line, error", [("gguf>=0.10", "not an exact pin"), ("cffi==1\ncffi==2", "pinned twice")])
def test_a_pin_list_that_is_not_exact_pins_is_refused(tmp_path, line, error):
    bad = tmp_path / "pins.txt"
    bad.write_text(f"# a comment\n\n{line}\n")
    with pytest.raises(ValueError, match=error):
        gpu_wheels.read_pins(bad)


def test_wheels_are_checked_against_the_pins(tmp_path):
    pins = {"cffi": "2.1.1", "gguf": "0.19.0"}
    (tmp_path / "cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"")
    (tmp_path / "gguf-0.18.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "extra_thing-1.0-py3-none-any.whl").write_bytes(b"")
    problems = gpu_wheels.check_wheels(tmp_path, pins)
    assert any("gguf" in p and "0.18.0" in p for p in problems)
    assert any("extra-thing" in p for p in problems) and not any(p.startswith("cffi") for p in problems)


def test_peers_are_installed_from_their_archives_links_kept(tmp_path):
    """.peers/'s .tar.xz archives (a package as installed, its libraries once, the other names links) go
    into the site folder as they are; nothing in .peers/, nothing installed."""
    import tarfile

    package = tmp_path / "build" / "peerpkg"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 7\n")
    (package / "lib" / "libpeer.so.0").write_bytes(b"\x7fELF not really")
    (package / "lib" / "libpeer.so").symlink_to("libpeer.so.0")
    peers, site = tmp_path / ".peers", tmp_path / "site"
    peers.mkdir()
    record = gpu_check.Record("setup", "", 1)
    assert gpu_check.install_peers(peers, site, sys.executable, record) == []
    with tarfile.open(peers / "peerpkg-1.0-cuda.tar.xz", "w:xz") as tar:
        tar.add(package, arcname="peerpkg")
    assert gpu_check.install_peers(peers, site, sys.executable, record) == ["peerpkg"]
    assert (site / "peerpkg" / "lib" / "libpeer.so").is_symlink() and record.counts["peers"] == 1
    assert (site / "peerpkg" / "lib" / "libpeer.so").read_bytes() == b"\x7fELF not really"


def test_the_matvec_stage_times_the_library_and_its_variants(tmp_path):
    out = tmp_path / "out"
    rc = gpu_check.main(["--dir", str(out), "--backend", "host", "--stages", "matvec", "--cap", "matvec=120"])
    result = json.loads((out / "gpu_check.json").read_text())
    (stage,) = [s for s in result["stages"] if s["name"] == "matvec"]
    assert stage["ok"] and rc == 0, stage
    first = result["matvec"][0]
    assert Path(first["library"]).name == "libpebble_host.so" and set(first["token_ms"]) == {"1", "8"}
    assert all(ms > 0 for ms in first["token_ms"].values())
    assert "a Llama-3-8B Q4_K_M token's products" in (out / "summary.txt").read_text()


def test_a_pytest_id_is_made_from_a_junit_name():
    assert gpu_check.node_id("tests.test_decode_step::test_one[cuda-llama-Q4_K_M-23]") == \
        "tests/test_decode_step.py::test_one[cuda-llama-Q4_K_M-23]"
    assert gpu_check.node_id("no.such.module::test_x") == "no.such.module::test_x"


FAKE_PYTEST = '''
import os, sys
junit = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
ids = [a for a in sys.argv[1:] if "::" in a]
bad = os.environ.get("PEBBLING_CUDA_STACK") != "0"  # the stacked launch "at fault"
cases = "".join(f'<testcase classname="m" name="{i}">' + ('<failure message="wrong"/>' if bad else "") + "</testcase>"
                for i in ids)
open(junit, "w").write(f'<testsuite tests="{len(ids)}" failures="{len(ids) if bad else 0}" errors="0" skipped="0">'
                       f"{cases}</testsuite>")
print("ran", ids, "stack", os.environ.get("PEBBLING_CUDA_STACK"))
raise SystemExit(1 if bad else 0)
'''


def test_failed_kernel_tests_run_again_under_each_switch_naming_the_one_that_mends_them(tmp_path):
    """try_switches on a stand-in for pytest whose tests pass only with PEBBLING_CUDA_STACK=0: that switch and
    all of them together pass, each other fails; every run is logged after the kernels' own."""
    failed = gpu_check.Record("kernels", "", 1, log="kernels.log",
                              failures=[{"test": "tests.test_decode_step::test_a[cuda]", "kind": "failure"},
                                        {"test": "tests.test_attend::test_b", "kind": "failure"}])
    (tmp_path / "kernels.log").write_text("the kernels' run\n")
    found = gpu_check.try_switches(failed, [sys.executable, "-c", FAKE_PYTEST], {"PATH": "/usr/bin:/bin"}, tmp_path, 120)
    assert found["tests"] == ["tests/test_attend.py::test_b", "tests/test_decode_step.py::test_a[cuda]"]
    assert {k: (v["passed"], v["failed"]) for k, v in found.items() if k != "tests"} == {
        "PEBBLING_CUDA_STACK=0": (2, 0), "PEBBLING_CUDA_GROUP=1": (0, 2), "PEBBLING_CUDA_PERSIST=0": (0, 2),
        "PEBBLING_CUDA_SPLIT=0": (0, 2), "PEBBLING_CUDA_MATVEC=float": (0, 2), "PEBBLING_CUDA_DENSE=0": (0, 2),
        "+".join(gpu_check.SWITCHES): (2, 0)}
    log = (tmp_path / "kernels.log").read_text()
    assert log.startswith("the kernels' run") and log.count("=== the failed tests again with") == 7
    assert "stack 0" in log and "PEBBLING_CUDA_STACK=0: 2 passed, 0 failed" in gpu_check.switches_text(found)

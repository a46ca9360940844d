"""A run ends with its skips grouped by reason (tests/conftest.py), so that hundreds of skips read as the few
things they are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_ends_with_its_skips_counted_by_reason():
    env = {**os.environ, "PEBBLING_TEST_BACKENDS": "stub"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_quant_kernels.py",
                           "-k", "type_block and (Q4_K or Q2_K)"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    summary = done.stdout.split("skipped, by reason")[-1]
    # the host and cuda cases of both types: one line, counted
    assert re.search(r"^\s+4  left out by PEBBLING_TEST_BACKENDS=stub$", summary, re.M), done.stdout[-2000:]
    counts = [int(m) for m in re.findall(r"^\s+(\d+)  ", summary, re.M)]
    assert counts and sum(counts) == int(re.search(r"(\d+) skipped", done.stdout).group(1))


def test_the_tests_make_test_leaves_to_ci_are_counted_and_named():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not ci",
                           "tests/test_quant_kernels.py", "-k", "under_each_setting"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    # the five settings that rerun the kernel tests in a process of their own; the two malformed ones stay
    assert "5 deselected as `ci` tests: `make test-ci` runs them" in done.stdout, done.stdout[-2000:]
    assert re.search(r"\b2 passed", done.stdout), done.stdout[-2000:]

"""Shared fixtures. `store_backend`: the name of each store backend, one test per backend present
(the params come from helpers.store_backend_params, which test files parametrize with too).

`--no-skip-gpu`: a GPU test that is skipped (CuPy missing, the cuda library not built, no device, a
`pytest.skip` inside it) fails instead, with the skip's reason, so that a run on a GPU machine cannot
look green while the GPU code never ran. A GPU test is one run on the cuda backend (a parameter naming
it), or one marked `gpu` whose parameters name no other backend.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest
from helpers import store_backend_params
from pyplugin.runtime.generation import Generation
from pyplugin.store import BACKENDS
from server_patch import create_app
from server_patch.local import serving

# The demo model is written into pebbling's cache: a directory of this session's, never the user's
# (set here, before any test, so that the servers and commands the tests start find it too).
_CACHE = tempfile.TemporaryDirectory(prefix="pebbling-cache-tests-")
os.environ["PEBBLING_CACHE"] = _CACHE.name
# Nor the user's models: a test that names no models directory gets an empty one, not ./models (which
# `make serve` fills, and which every command finds where $PEBBLING_MODELS is not set).
_MODELS = tempfile.TemporaryDirectory(prefix="pebbling-models-tests-")
os.environ["PEBBLING_MODELS"] = _MODELS.name

NO_SKIP_GPU = "--no-skip-gpu"


def pytest_addoption(parser) -> None:
    parser.addoption(NO_SKIP_GPU, action="store_true", default=False,
                     help="count a skipped GPU test (cuda backend, or marked gpu) as a failure, with its reason")


@pytest.fixture(params=store_backend_params())
def store_backend(request) -> str:
    return request.param


def _backends_named(value) -> set[str]:
    if isinstance(value, str):
        return {value} & set(BACKENDS)
    if isinstance(value, (tuple, list)):
        return set().union(*(_backends_named(v) for v in value)) if value else set()
    return set()


def is_gpu_test(item) -> bool:
    """Whether `item` runs on the GPU: a parameter names the cuda backend, or it is marked gpu and
    no parameter names another backend (a gpu-marked test's host and stub cases are not GPU tests)."""
    callspec = getattr(item, "callspec", None)
    named = set().union(*(_backends_named(v) for v in callspec.params.values())) if callspec else set()
    if named:
        return "cuda" in named
    return item.get_closest_marker("gpu") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and item.config.getoption(NO_SKIP_GPU) and is_gpu_test(item)):
        return
    if hasattr(report, "wasxfail"):  # an expected failure is not a skip
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"GPU test skipped under {NO_SKIP_GPU}: {reason}"


@pytest.fixture
def slow_tokens(monkeypatch):
    """Every token takes 10 ms to sample and none ends the generation, so that requests overlap for sure."""
    real = Generation.sample

    def sample(self, logits, history):
        time.sleep(0.01)
        logits = np.array(logits, dtype=np.float32)
        logits[list(self.model.tokenizer.eog_ids)] = -np.inf
        return real(self, logits, history)

    monkeypatch.setattr(Generation, "sample", sample)


# The tests marked `ci` that -m "not ci" left out, counted where they were collected: in this process, or in
# pytest-xdist's workers (each collects the whole suite), which report them when they end.
_ci_left = [0]


def pytest_deselected(items) -> None:
    _ci_left[0] += sum(1 for item in items if item.get_closest_marker("ci"))


def pytest_sessionfinish(session) -> None:
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["ci_left"] = _ci_left[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _ci_left[0] = max(_ci_left[0], getattr(node, "workeroutput", {}).get("ci_left", 0))


def pytest_terminal_summary(terminalreporter) -> None:
    """The skips grouped by reason, most first, so that a run's hundreds of skips read as the few things they
    are (the GPU cases where no GPU is; a backend left out by PEBBLING_TEST_BACKENDS ...)."""
    if _ci_left[0]:  # `make test`'s -m "not ci"
        terminalreporter.write_line(f"{_ci_left[0]} deselected as `ci` tests: `make test-ci` runs them (CI does)")
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return
    terminalreporter.section(f"{sum(reasons.values())} skipped, by reason")
    for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.write_line(f"{count:6d}  {reason}")


@pytest.fixture(scope="module")
def url(models):
    """A server over the test module's `models` folder (a fixture of its own), started once for the module."""
    with serving(create_app(models_dir=models)) as url:
        yield url

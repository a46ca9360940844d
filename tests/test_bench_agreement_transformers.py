"""The parts of `benchmarks/agreement.py transformers` that decide what it reports, checked without
torch: the Q/K order handed to transformers, the budgets, and the acceptance verdicts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib import agreement_transformers as bench  # noqa: E402

from pyplugin.runtime.plan import MemoryModel, full_residency_peak, make_plan, smallest_footprint  # noqa: E402
from pyplugin.model.synth import permute_qk  # noqa: E402


def memory(n_layers: int) -> MemoryModel:
    return MemoryModel(layer_weight_bytes=(1000,) * n_layers, layer_kv_bytes=100, kv_bytes_per_token=1,
                       fixed_bytes=300, workspace_bytes=200, overhead_bytes=50)


@pytest.mark.parametrize("n_head", [1, 4])
def test_unpermute_qk_gives_back_the_hugging_face_rows_synth_permuted(n_head):
    w = np.arange(n_head * 8 * 3, dtype=np.float32).reshape(n_head * 8, 3)
    permuted = permute_qk(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(bench.unpermute_qk(permuted, n_head), w)


def test_full_budget_is_the_none_footprint_and_smaller_ones_take_weight_room_only():
    m = memory(8)
    full, note = bench.fraction_budget(m, 1.0)
    assert (full, note) == (full_residency_peak(m), "")
    assert len(make_plan(m, "adaptive", full).resident) == 8
    half, _ = bench.fraction_budget(m, 0.5)
    assert full - half == 4000  # half of the 8000 weight bytes, nothing else
    assert len(make_plan(m, "adaptive", half).resident) < 8


def test_budget_below_the_minimal_footprint_is_raised_to_it_and_says_so():
    m = memory(2)
    budget, note = bench.fraction_budget(m, 0.25)
    assert budget == smallest_footprint(m)
    assert "raised" in note


def test_first_divergence_names_the_first_step_that_differs():
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_divergence([1, 2], [1, 2, 3]) == 2
    assert bench.first_divergence([1, 2], None) is None


def _row(label, *, efficiency=None, tok_s=10.0, same=True, budget=None, peak=100, est=100):
    return {"label": label, "efficiency": efficiency, "decode_tokens_per_s": tok_s, "tokens_equal_none": same,
            "within_budget": None if budget is None else peak <= budget, "peak_over_estimate": peak / est,
            "measured_how": "byte-accounted"}


def test_acceptance_computes_each_goal_of_issue_6():
    pebbling = [_row("none", tok_s=50.0), _row("25%", efficiency=0.9, tok_s=12.0, budget=100),
                _row("minimal", efficiency=0.5, tok_s=8.0, peak=110)]
    hf = [{"label": "cuda", "decode_tokens_per_s": 40.0}, {"label": "25%", "decode_tokens_per_s": 5.0}]
    verdicts = {c["check"]: c["verdict"] for c in bench.acceptance(pebbling, hf, "cuda")}
    assert verdicts == {
        "every strategy: tokens identical to none": "PASS",
        "measured peak never above the budget": "PASS",
        "measured peak within 5% of the estimate": "FAIL",          # minimal is 10% over
        "streaming efficiency at 25%": "PASS",
        "streaming efficiency at minimal": "FAIL",
        "decode tok/s at 25%: pebbling / transformers+accelerate": "FAIL",   # 2.4x, goal 3x
        "decode tok/s: none / transformers fully on the cuda": "PASS",       # 1.25x
    }


def test_acceptance_says_n_a_where_a_row_was_not_run():
    pebbling = [_row("25%", efficiency=0.9, same=None, budget=100), _row("minimal", efficiency=0.9, same=None)]
    checks = {c["check"]: c for c in bench.acceptance(pebbling, [{"label": "cpu", "decode_tokens_per_s": 1.0}],
                                                      "cpu")}
    assert checks["every strategy: tokens identical to none"]["verdict"] == "n/a"
    assert checks["decode tok/s at 25%: pebbling / transformers+accelerate"]["verdict"] == "n/a"
    assert checks["decode tok/s: none / transformers fully on the cpu"]["verdict"] == "n/a"

"""`benchmarks/agreement.py shift`: a generation past num_ctx goes on after a shift, for every
architecture, and shifts as llama.cpp's server does. Where llama-cpp-python is importable the whole
comparison runs against llama.cpp (every case agrees at the default f16 KV cache); elsewhere pebbling's half
of it: the generation goes past num_ctx, its shifts are the ones llama.cpp's server rule makes (written out
in the script), and the kept keys' re-rotation is what moves its logits after a shift."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib import agreement_shift as shift  # noqa: E402

from pyplugin.model import kv_shift  # noqa: E402

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def test_the_schedule_is_llama_cpp_servers_on_its_own_log():
    """llama.cpp's server logged, at n_ctx 512 with n_keep 1 (its BOS-less count of 0 plus the BOS):
    n_past 511, n_discard 255; the script's rule (and pebbling's) says the same."""
    assert shift.llama_server_shift(510, 512, 0, True) is None
    assert shift.llama_server_shift(511, 512, 0, True) == (1, 255)
    # a 12-token prompt at num_ctx 32, num_keep 4 and a BOS: shifts before tokens 19, 32 and 45 go in
    assert shift.expected_shifts(12, 48, 32, True) == [(19, 5, 13), (32, 5, 13), (45, 5, 13)]


@pytest.mark.parametrize("case", shift.CASES, ids=lambda c: c.name)
def test_a_generation_past_num_ctx_shifts_as_llama_cpp_does(case, tmp_path):
    if HAS_LLAMA_CPP:
        row = shift.compare_case(case, tmp_path, "f16")
        assert row["status"].startswith("ok"), row
        assert row["rel_err_after"] <= row["tolerance"] < row["control_after"]
        return
    path, model, prompt, run = shift.pebbling_half(case, tmp_path, "f16")
    assert len(run.tokens) == shift.N_GEN and run.done_reason == "length"
    add_bos = bool(model.tokenizer.add_bos and model.tokenizer.bos_id is not None)
    assert run.shifts == shift.expected_shifts(len(prompt), shift.N_GEN, shift.N_CTX, add_bos)
    assert len(run.shifts) == 3
    with mock.patch.object(kv_shift, "rotate", lambda cfg, rows, delta: rows), shift.ggml_gelu(model):
        unrotated = shift.run_pebbling(model, prompt, "f16", forced=run.tokens)
    first = run.shifts[0][0]  # logits past it come after the first shift
    moved = [np.abs(a - b).max() / np.abs(a).max() for a, b in zip(run.logits, unrotated.logits)]
    assert max(moved[:first + 1]) <= 1e-6 and max(moved[first + 1:]) > 1e-2

"""`benchmarks/speed.py profile` at a tiny size: the share of decode time inside the native step and the calls
per step are measured and reported (the figures themselves come from a full run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib import speed_profile as profile_decode  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_tiny_profile_reports_where_decode_time_goes(tmp_path, capsys):
    out = tmp_path / "profile.json"
    result = profile_decode.main(["--n-layer", "2", "--context", "12", "--tokens", "6", "--runs", "2",
                                  "--dir", str(tmp_path), "--json", str(out), "--attention-contexts", "64,256",
                                  "--kv-type", "f16,q8_0"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["n_layer"] == 2 and list(result["kv_types"]) == ["f16", "q8_0"]
    for kv in result["kv_types"].values():
        assert len(kv["runs"]) == 2
        for run in kv["runs"]:
            assert 0 < run["native_share"] < 1 and run["decode_tok_per_s"] > 0 and run["python_ms_per_token"] > 0
            assert 1 <= run["native_calls_per_step"] <= 4
        assert [a["context"] for a in kv["attention"]] == [64, 256]
        assert all(a["ms_per_layer"] > 0 and a["ms_per_token"] == pytest.approx(2 * a["ms_per_layer"])
                   and a["ms_per_layer_from_memory"] > 0
                   and a["ms_per_token_from_memory"] == pytest.approx(2 * a["ms_per_layer_from_memory"])
                   for a in kv["attention"])
    q8 = result["kv_types"]["q8_0"]
    assert q8["decode_vs_first"] == pytest.approx(q8["median"]["decode_tok_per_s"]
                                                  / result["kv_types"]["f16"]["median"]["decode_tok_per_s"])
    text = capsys.readouterr().out
    assert "native calls per step" in text and "KV q8_0 decodes at" in text and "as a step reads them" in text

"""`benchmarks/server.py load` at a tiny size: a server process, the same requests one at a time and
at once, and what it reports (the figures themselves come from a full run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib import server_load as bench  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_tiny_run_compares_concurrent_clients_with_one_at_a_time(tmp_path, capsys):
    out = tmp_path / "load.json"
    result = bench.main(["--clients", "3", "--tokens", "12", "--repeats", "2", "--n-layer", "2", "--n-embd", "64",
                         "--n-ff", "128", "--backend", "stub", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["same_answers"] is True
    assert result["backend"] == "stub" and result["strategy"] == "minimal" and result["num_parallel"] == 3
    for phase in ("serial", "batched"):
        p = result[phase]
        assert 0 < p["generated_tokens"] <= 3 * 12 and p["aggregate_tok_per_s"] > 0
        assert p["bytes_restored_per_generated_token"] == 0  # the stub's arrays are host memory: nothing copied
    assert result["serial"]["largest_batch"] == 1  # one at a time means alone
    assert result["batched"]["generated_tokens"] == result["serial"]["generated_tokens"]
    assert result["bytes_restored_ratio"] is None
    assert "speedup" in capsys.readouterr().out

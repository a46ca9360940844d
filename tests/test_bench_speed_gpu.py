"""`benchmarks/speed.py gpu` at a size a CPU runs in seconds: every row and figure is there and measured
(not a placeholder), estimates are labelled, and the files it writes have Llama-3-8B's shape and mix."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from lib import speed_gpu as bench_gpu  # noqa: E402
from lib.gpu_model import spec_for, tensor_list, write_model  # noqa: E402

ROW_FIGURES = ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_ms_per_step", "estimated_peak_bytes",
               "report_peak_bytes", "weights_GBps", "roofline_fraction", "weight_bytes_per_step")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gpu")
    got = bench_gpu.main(["--backend", "host", "--shape", "tiny", "--layers", "4", "--tokens", "4", "--prompt", "8",
                          "--json", str(out / "bench.json"), "--text", str(out / "bench.txt"), "--dir", str(out)])
    return got, json.loads((out / "bench.json").read_text()), (out / "bench.txt").read_text()


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_every_row_of_every_file_and_batch_is_there_with_measured_figures(result):
    _, data, _ = result
    assert [f["type"] for f in data["files"]] == ["Q4_K_M", "F16"]
    for f in data["files"]:
        got = [(r["label"], r["batch"]) for r in f["rows"]]
        assert got == [(label, b) for b in (1, 8) for label in ("none", "50%", "25%", "minimal")]
        for r in f["rows"]:
            for key in ROW_FIGURES:
                assert positive(r[key]), (f["type"], r["label"], key, r[key])
            assert r["tokens_equal"] is True and len(r["tokens"]) == r["batch"]
            assert all(len(t) == 4 for t in r["tokens"])
            # no GPU: the peak is the store's byte accounting, and NVML's sampled peak says why it is absent
            assert r["nvml_peak_bytes"] is None and r["nvml_peak_how"].startswith("not measured")
            assert r["report_peak_how"].startswith("byte-accounted")
            # one library step call a decoded token (a step of the batch), inside the step's wall time;
            # no device time without CUDA events
            assert r["step_calls"] == 4 and 0 < r["inside_step_ms"] < r["decode_ms_per_step"]
            assert r["device_step_ms"] is None
        assert positive(f["write_s"]) and positive(f["load_s"]) and f["layer_bytes_stored"] > 0
        assert f["device_over_stored"] == pytest.approx(1.0, abs=0.02)


def test_rows_differ_as_their_strategies_do(result):
    _, data, _ = result
    rows = {(r["label"], r["batch"]): r for r in data["files"][0]["rows"]}
    assert rows[("none", 1)]["resident_layers"] == 4 and rows[("minimal", 1)]["resident_layers"] == 0
    assert rows[("minimal", 1)]["estimated_peak_bytes"] < rows[("none", 1)]["estimated_peak_bytes"]
    for label in ("50%", "25%"):
        assert rows[(label, 1)]["budget_bytes"] > 0 and rows[(label, 1)]["within_budget"] is True
    # eight sequences hold eight KV caches
    assert rows[("none", 8)]["estimated_peak_bytes"] > rows[("none", 1)]["estimated_peak_bytes"]


def test_each_row_gives_its_estimate_in_parts_beside_the_parts_measured(result):
    """The estimate's parts add up to it, and the store's device tier peaked within its part (the host
    backend's store is byte-accounted); CuPy's pool is only sampled on a GPU."""
    _, data, _ = result
    assert any(k.startswith("memory") and "estimate" in v for k, v in data["estimates"].items())
    for f in data["files"]:
        for r in f["rows"]:
            m = r["memory"]
            parts = ("store_limit_bytes", "slots_bytes", "fixed_bytes", "workspace_bytes", "overhead_bytes",
                     "margin_bytes", "expert_bytes", "decoder_bytes")
            assert sum(m[k] for k in parts) == r["estimated_peak_bytes"], (f["type"], r["label"], m)
            assert 0 <= m["store_device_peak_bytes"] <= m["store_limit_bytes"], (f["type"], r["label"], m)
            assert m["pool_peak_bytes"] is None
    rows = {(r["label"], r["batch"]): r["memory"] for r in data["files"][0]["rows"]}
    assert rows[("minimal", 1)]["slots_bytes"] > 0 and rows[("none", 1)]["slots_bytes"] == 0
    assert rows[("minimal", 1)]["store_limit_bytes"] == 0 < rows[("none", 1)]["store_device_peak_bytes"]


def test_the_bandwidths_are_measured_and_the_estimates_labelled(result):
    _, data, text = result
    assert positive(data["bus"]["h2d_restore_GBps"]) and "no GPU" in data["bus"]["path"]
    assert positive(data["hbm"]["GBps"]) and "not HBM" in data["hbm"]["how"]
    nominal = data["bus"]["nominal_link_GBps"]   # NVML's PCIe generation x width where a GPU is; else absent, not guessed
    assert (nominal is None and data["bus"]["why"]) or (positive(nominal) and data["bus"]["pcie_width"] >= 1)
    assert "estimated_peak_bytes" in data["estimates"] and "bus.nominal_link_GBps" in data["estimates"]
    assert "est." in text and "measured" in text


def test_absent_peers_are_recorded_with_the_reason(result):
    _, data, text = result
    for name in ("transformers", "llama.cpp"):
        peer = data["peers"][name]
        if not peer["present"]:
            assert "import" in peer["why"] and f"peer {name}: absent" in text
        else:
            assert all(positive(r["decode_tokens_per_s"]) for r in peer["rows"])


def test_the_json_is_what_main_returns_and_names_no_local_path(result):
    got, data, _ = result
    assert data["config"] == got["config"] and data["table"] == got["table"]
    assert all("/" not in f["path"] for f in data["files"])


def test_the_llama3_8b_shape_has_8_billion_parameters_in_llama_cpps_q4_k_m_mix():
    spec = spec_for("llama3-8b", "Q4_K_M", None, 4096)
    tensors = tensor_list(spec, spec.vocab_size)
    assert sum(math.prod(shape) for _, shape, _ in tensors) == 8_030_261_248
    types = {name: t for name, _, t in tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.1.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_v.weight"] == "Q6_K"
    assert {t for _, _, t in tensor_list(spec_for("llama3-8b", "F16", 2, 4096), 128256)} == {"F16", "F32"}


def test_written_files_hold_the_types_and_bytes_they_declare(tmp_path):
    spec = spec_for("tiny", "Q4_K_M", 2, 256)
    reader = GGUFReader(write_model(tmp_path / "m.gguf", spec))
    by_name = {t.name: t for t in reader.tensors}
    assert by_name["blk.0.ffn_down.weight"].tensor_type.name == "Q6_K"
    assert by_name["blk.1.attn_q.weight"].tensor_type.name == "Q4_K"
    assert by_name["output.weight"].n_bytes == 2048 * 256 // 256 * 210   # Q6_K: 210 bytes per 256 values


def test_the_acceptance_checks_report_what_a_cpu_run_can_judge_and_leave_the_rest_open(result):
    _, data, text = result
    checks = data["acceptance"]
    assert {c["item"] for c in checks} == {2, 3, 4, 6}   # 5: nothing is restored on the host library
    verdicts = {c["check"]: c["verdict"] for c in checks}
    assert verdicts["Q4_K_M none batch 1: greedy tokens equal none's"] == "PASS"
    assert verdicts["Q4_K_M: device weight bytes / stored bytes"] == "PASS"
    # what needs a GPU or a peer is left open, never passed
    assert verdicts["Q4_K_M none batch 1: roofline fraction"] == "n/a"
    assert verdicts["F16 25%: decode / transformers + accelerate at 25%"] == "n/a"
    assert "FAIL" not in verdicts.values() and "acceptance (issue 25)" in text


def test_a_row_that_breaks_is_recorded_and_the_other_rows_still_run(tmp_path, monkeypatch):
    real = bench_gpu.run_row

    def breaks_at_25(pebbled, options, prompts, case, n_decode, *rest):
        if case.get("label") == "25%":
            raise RuntimeError("a kernel fault, say")
        return real(pebbled, options, prompts, case, n_decode, *rest)

    monkeypatch.setattr(bench_gpu, "run_row", breaks_at_25)
    got = bench_gpu.main(["--backend", "host", "--shape", "tiny", "--layers", "2", "--tokens", "2", "--prompt", "4",
                          "--types", "F16", "--batches", "1", "--peers", "none", "--dir", str(tmp_path)])
    rows = {r["label"]: r for r in got["files"][0]["rows"]}
    assert "a kernel fault, say" in rows["25%"]["error"] and "speed_gpu.py" in rows["25%"]["error"]
    assert positive(rows["minimal"]["decode_tokens_per_s"]) and rows["minimal"]["tokens_equal"]
    failed = [c for c in got["acceptance"] if c["verdict"] == "FAIL"]
    assert [c["check"] for c in failed] == ["F16 25% batch 1: the row ran"]
    assert any("ERROR" in line for line in got["table"])


def test_a_batchs_restores_a_step_are_every_sequences_share():
    """A batch's report is sequence 0's, whose restored bytes a token are its share of each step (the
    step's over the batch): a step of 8 restores 8 shares, and the transfer bound is the step's."""
    report = {"bytes_restored_per_token": 1_000_000, "strategy": "minimal", "resident_layers": 0, "n_layers": 4,
              "estimated_peak_bytes": 100, "measured_peak_bytes": 100, "measured_peak_how": "x",
              "bytes_restored": 64_000_000}
    run = {"report": report, "prefill_s": 1.0, "decode_s": 0.08, "nvml_peak_bytes": 100, "nvml_peak_how": "x",
           "tokens": [[1]] * 8, "step_calls": 8, "inside_step_s": 0.06, "device_step_s": 0.072}
    case = {"label": "minimal", "budget": None, "note": ""}
    row = bench_gpu.row_figures(case, 8, run, 8, 8, 1000, bus_bps=50e9, hbm_bps=4e12)
    assert row["bytes_restored_per_step"] == 8_000_000
    assert row["transfer_bound_ms"] == pytest.approx(8e6 / 50e9 * 1e3, rel=1e-3)
    assert row["achieved_h2d_GBps"] == pytest.approx(8e6 / 0.01 / 1e9, rel=1e-3)
    assert (row["inside_step_ms"], row["device_step_ms"]) == (7.5, 9.0)


def test_a_peak_over_its_budget_says_which_part_it_came_from():
    """A row whose NVML peak is over its budget fails item 2 with the peak part by part: CuPy's pool against
    its parts of the estimate, the store's tier against its limit, and what lies beyond both against the
    overhead; a row within its budget, or one whose pool was not sampled, says nothing more."""
    from lib.gpu_acceptance import acceptance, acceptance_lines

    memory = {"store_limit_bytes": 0, "slots_bytes": 600, "fixed_bytes": 100, "workspace_bytes": 50,
              "overhead_bytes": 200, "margin_bytes": 40, "expert_bytes": 0, "decoder_bytes": 7,
              "store_device_peak_bytes": 0, "pool_peak_bytes": 790}
    row = {"label": "25%", "batch": 1, "budget_bytes": 990, "nvml_peak_bytes": 1002, "estimated_peak_bytes": 990,
           "peak_over_estimate": 1.012, "tokens_equal": True, "tokens_compared_with": "none",
           "bytes_restored_per_step": 0, "memory": memory}
    result = {"config": {"backend": "cuda"}, "files": [{"type": "F16", "rows": [row, dict(row, label="minimal",
              budget_bytes=None), dict(row, label="50%", budget_bytes=2000)]}]}
    budget = [c for c in acceptance(result) if c["check"].endswith("within the budget")]
    assert [c["verdict"] for c in budget] == ["FAIL", "PASS"]
    assert budget[0]["why"] == ("pool peak 790 B against 750 B estimated; store peak 0 B against 0 B; beyond both "
                                "212 B against overhead + margin + decoder 247 B")
    assert "why" not in budget[1]
    line = next(x for x in acceptance_lines(acceptance(result)) if "within the budget" in x)
    assert line.endswith("; " + budget[0]["why"])
    memory["pool_peak_bytes"] = None  # not sampled (no GPU): nothing to say
    assert "why" not in next(c for c in acceptance(result) if c["check"].endswith("within the budget"))

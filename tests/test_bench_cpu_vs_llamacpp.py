"""bench_cpu_vs_llamacpp says when the llama.cpp it measures was built without the vector extensions this CPU
has and pebbling's kernels use: such a build (a generic wheel) is slower than llama.cpp can be here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_cpu_vs_llamacpp as bench  # noqa: E402

GENERIC = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | REPACK = 1 |"
NATIVE = GENERIC + " AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 |"


def test_a_generic_build_on_an_avx512_cpu_is_flagged(monkeypatch):
    monkeypatch.setattr(bench, "cpu_model", lambda: "AMD EPYC (avx2, avx512f, avx512_vnni)")
    warning = bench.build_warning(GENERIC)
    assert warning and "AVX512, AVX512_VNNI" in warning and "GGML_NATIVE=ON" in warning
    assert bench.build_warning(NATIVE) is None


def test_a_cpu_without_avx512_asks_nothing_more(monkeypatch):
    monkeypatch.setattr(bench, "cpu_model", lambda: "Some CPU (avx2)")
    assert bench.build_warning(GENERIC) is None

"""`benchmarks/speed.py cpu` says when the llama.cpp it measures was built without the vector extensions this CPU
has and pebbling's kernels use: such a build (a generic wheel) is slower than llama.cpp can be here; and it
pairs each run with the llama.cpp run of the same round."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib import shapes  # noqa: E402
from lib import speed_cpu as bench  # noqa: E402

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


def test_the_qwen3_30b_a3b_file_is_its_q4_k_m_like_mix_of_17_gib():
    """Issue 28's acceptance 3 file: llama.cpp's Q4_K_M mix for a mixture of experts (Q4_K; Q6_K for the
    embedding, the output, and attn_v and the experts' down on every other layer), random blocks written
    directly, 17.3 GiB at 48 layers (as the real file), the sizes from the tensors it would write."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from pyplugin.model.synth import SynthSpec, _tensors
    shape = shapes.SHAPES["qwen3-30b-a3b"]
    types = shapes.q4_k_m(shape)
    assert shape["random_blocks"] and types["weight_type"] == "Q4_K"
    spec = SynthSpec(**{k: v for k, v in shape.items() if k != "vocab_size"}, **types)
    kinds, total = {}, 0
    for name, array, qtype in _tensors(spec, shapes.N_VOCAB, lazy=True):
        kinds[name] = qtype.name
        if isinstance(array, tuple):
            (dims, _), (block, size) = array, GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            total += math.prod(dims) // block * size
        else:
            total += array.nbytes
    assert kinds["blk.0.ffn_down_exps.weight"] == "Q6_K" and kinds["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert kinds["blk.7.ffn_gate_exps.weight"] == kinds["blk.7.ffn_up_exps.weight"] == "Q4_K"
    assert kinds["output.weight"] == kinds["token_embd.weight"] == "Q6_K"
    assert kinds["blk.3.ffn_gate_inp.weight"] == "F32"
    assert 17.0 < total / 2**30 < 17.6


def test_each_run_is_paired_with_the_llama_cpp_run_of_its_round():
    """A machine that slows down half-way: the medians' ratio pairs a fast llama.cpp run with a slow pebbling
    one, each run's own ratio does not."""
    base = [dict(decode_s=1.0, prefill_s=2.0), dict(decode_s=1.0, prefill_s=2.0), dict(decode_s=2.0, prefill_s=4.0)]
    runs = [dict(decode_s=0.9, prefill_s=1.0), dict(decode_s=1.8, prefill_s=2.0), dict(decode_s=1.8, prefill_s=2.0)]
    paired = bench.paired_ratios(base, runs)
    assert paired["decode"] == pytest.approx([1 / 0.9, 1 / 1.8, 2 / 1.8])
    assert paired["decode_median"] == pytest.approx(1 / 0.9) and paired["prefill_median"] == pytest.approx(2.0)

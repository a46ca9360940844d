"""The forward pass's row-wise steps (norms, rotations, gates) split among the host's threads for a long
prompt chunk (attention.by_rows): the same arrays, bit for bit, as computed in one piece, whatever the
number of threads; small or device arrays are not split."""

from __future__ import annotations

import numpy as np
import pytest

import pyplugin.model.attention as attention_module
from helpers import tiny_model
from pyplugin.model.transformer import apply_rope, gelu_tanh, rms_norm, rope_table, silu


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_split_rows_are_the_whole_call_bit_for_bit(monkeypatch, threads):
    rng = np.random.default_rng(3)
    cfg = tiny_model("qwen3").config.for_layer(0)
    T = 997  # rows that do not divide evenly
    x = rng.standard_normal((T, 1024)).astype(np.float32)
    w = rng.standard_normal(1024).astype(np.float32)
    q = rng.standard_normal((T, 16, cfg.head_dim)).astype(np.float32)
    cos, sin = (t[:T] for t in rope_table(cfg, 1024, np))
    whole = [rms_norm(x, w, 1e-6), silu(x), gelu_tanh(x), apply_rope(cfg, q, cos, sin)]
    calls = []
    monkeypatch.setattr(attention_module, "_attention_threads", lambda: threads)
    real_pool = attention_module._attention_pool

    def counting_pool():
        calls.append(1)
        return real_pool()
    monkeypatch.setattr(attention_module, "_attention_pool", counting_pool)
    split = [rms_norm(x, w, 1e-6), silu(x), gelu_tanh(x), apply_rope(cfg, q, cos, sin)]
    assert calls, "the arrays were large enough to be split"
    for a, b in zip(whole, split):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    # a small array is computed in one piece
    calls.clear()
    rms_norm(x[:8], w, 1e-6)
    assert not calls

"""YaRN RoPE scaling (Qwen2.5's and Qwen3's long-context files, gpt-oss): read from the file as llama.cpp reads
it, the angles and the cos/sin tables as GGML's rope_yarn computes them, every backend and strategy reading the
one table, and a context shift rotating keys without scaling them twice."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import tiny_model, tiny_path
from pyplugin.errors import ModelError
from pyplugin.model import load_model
from pyplugin.model.kv_shift import rotate
from pyplugin.model.transformer import apply_rope, rope_table

YARN = dict(rope_yarn=(4.0, 64), n_ctx=256)


def ggml_rope_yarn(n_dims: int, base: float, freq_scale: float, n_ctx_orig: int, positions: np.ndarray,
                   neox: bool) -> tuple[np.ndarray, np.ndarray]:
    """GGML's CPU rope with YaRN (ggml-cpu ops.cpp: ggml_rope_yarn_corr_dims, rope_yarn_ramp, rope_yarn),
    transcribed here on its own: beta_fast 32, beta_slow 1, ext_factor 1 and attn_factor 1 as llama.cpp passes
    them. cos and sin [positions, n_dims] in the order the head's dims are rotated."""
    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(0.0, math.floor(corr_dim(32.0))), min(n_dims - 1.0, math.ceil(corr_dim(1.0)))
    cos, sin = np.zeros((len(positions), n_dims)), np.zeros((len(positions), n_dims))
    for row, p in enumerate(positions):
        for i0 in range(0, n_dims, 2):
            theta_extrap = p * base ** (-i0 / n_dims)
            theta_interp = freq_scale * theta_extrap
            ramp = 1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))
            theta = theta_interp * (1 - ramp) + theta_extrap * ramp
            mscale = 1.0 + 0.1 * math.log(1.0 / freq_scale)
            first, second = (i0 // 2, i0 // 2 + n_dims // 2) if neox else (i0, i0 + 1)
            cos[row, first] = cos[row, second] = math.cos(theta) * mscale
            sin[row, first], sin[row, second] = -math.sin(theta) * mscale, math.sin(theta) * mscale
    return cos, sin


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # NeoX's halves and GGML's normal pairs
def test_the_table_is_ggmls_rope_yarn(arch):
    cfg = tiny_model(arch, **YARN).config
    assert cfg.rope_freq_scale == 0.25 and cfg.rope_yarn == (1.0, 32.0, 1.0, 64)
    assert cfg.rope_mscale == pytest.approx(1 + 0.1 * math.log(4))
    positions = np.array([0, 1, 7, 63, 64, 200, 255])
    cos, sin = rope_table(cfg, 256, np, np.float64)
    want_cos, want_sin = ggml_rope_yarn(cfg.rope_dims, cfg.rope_theta, 0.25, 64, positions, arch == "qwen2")
    np.testing.assert_allclose(cos[positions, 0], want_cos, rtol=0, atol=1e-12)
    np.testing.assert_allclose(sin[positions, 0], want_sin, rtol=0, atol=1e-12)
    # the blend does something: the slowest pairs turn at a quarter of the unscaled rate, the fastest unscaled
    plain = tiny_model(arch, n_ctx=256).config
    p_cos, _ = rope_table(plain, 256, np, np.float64)
    assert np.allclose(cos[200, 0, 0], p_cos[200, 0, 0] * cfg.rope_mscale)  # pair 0: below beta_fast's dim
    assert not np.allclose(cos[200, 0], p_cos[200, 0] * cfg.rope_mscale)


def test_a_shifted_key_is_rotated_not_scaled_again():
    """A context shift turns a cached key (rotated once, with YaRN's scale) by -d: R(-d) m R(p) k = m R(p - d) k;
    GGML's K-shift, which rotates with the table, would scale it a second time."""
    cfg = tiny_model("qwen2", **YARN).config
    raw = np.random.default_rng(4).standard_normal((40, cfg.n_head_kv, cfg.head_dim)).astype(np.float32)
    cos, sin = rope_table(cfg, 40, np, np.float32)
    k = apply_rope(cfg, raw, cos, sin)
    moved = rotate(cfg, k[30:], -20)
    np.testing.assert_allclose(moved, apply_rope(cfg, raw[30:], cos[10:20], sin[10:20]), atol=1e-4)


def test_the_file_says_yarn_and_its_constants_or_is_refused_by_name():
    path = tiny_path("qwen2", **YARN, metadata={"qwen2.rope.scaling.attn_factor": 2.0})
    cfg = load_model(path, progress=False).config
    assert cfg.rope_mscale == pytest.approx(2 * (1 + 0.1 * math.log(4)))
    assert load_model(tiny_path("qwen2", rope_yarn=(4.0, 256), n_ctx=256), progress=False).config.rope_yarn[3] == 256
    for key, value in (("yarn_beta_slow", 2.0), ("yarn_ext_factor", 0.5), ("yarn_log_multiplier", 0.25)):
        with pytest.raises(ModelError, match=f"'qwen2.rope.scaling.{key}' is {value}; pebbling computes YaRN"):
            load_model(tiny_path("qwen2", **YARN, metadata={f"qwen2.rope.scaling.{key}": value}), progress=False)
    with pytest.raises(ModelError, match="'llama.rope.scaling.yarn_beta_fast' with rope scaling 'linear'"):
        load_model(tiny_path("llama", rope_linear_factor=2.0, metadata={"llama.rope.scaling.yarn_beta_fast": 32.0}),
                   progress=False)


def test_every_backend_and_strategy_decodes_a_yarn_file_as_none_does(capsys):
    """The native decode steps take the table as it is: the host library's tokens equal the stub's, and every
    strategy's equal none's (pebbling verify)."""
    from pyplugin.cli import main

    path = str(tiny_path("qwen2", **YARN))
    for backend in ("stub", "host"):
        assert main(["verify", path, "--num-predict", "8", "--num-ctx", "128", "--backend", backend]) == 0
        assert "OK: all" in capsys.readouterr().out

"""Rotary position embeddings as GGML computes them: the angle of each rotated pair (linear and llama3
scaling, YaRN), the cos and sin tables every backend reads (the native decode steps take them as they are),
and the rotation of a chunk's q and k. ``cfg`` is a layer's ModelConfig (pyplugin.model.transformer).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from ..xp import compute_dtype, get_array_module
from .attention import by_rows

Array = Any
ModelConfig = Any  # pyplugin.model.transformer.ModelConfig, which imports this module

ROPE_NORMAL, ROPE_NEOX = "normal", "neox"
# YaRN's keys under a file's architecture, and the values pebbling computes with (llama.cpp's defaults; a file
# that asks for others is refused: load._rope_scaling)
YARN_FIXED = {"rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
              "rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_attn_factor": 1.0,
              "rope.scaling.yarn_log_multiplier": 0.0}


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Angle per position of each rotated pair, as GGML computes it: scale * theta^(-2i/n) / factor; with
    YaRN (rope_yarn) the scaled angle blended back toward the unscaled one on the pairs that turn fast,
    by GGML's ramp between its correction dimensions (ggml_rope_yarn_corr_dims, rope_yarn)."""
    i = np.arange(cfg.rope_dims // 2, dtype=np.float64)
    extrap = cfg.rope_theta ** (-2.0 * i / cfg.rope_dims)
    if cfg.rope_freq_factors is not None:
        extrap = extrap / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
    inv = cfg.rope_freq_scale * extrap
    if cfg.rope_yarn is not None and cfg.rope_yarn[0] != 0.0:
        ext_factor, beta_fast, beta_slow, n_ctx_orig = cfg.rope_yarn
        low, high = yarn_corr_dims(cfg.rope_dims, n_ctx_orig, cfg.rope_theta, beta_fast, beta_slow)
        mix = (1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)) * ext_factor
        inv = inv * (1.0 - mix) + extrap * mix
    return inv


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The pairs between which YaRN's ramp runs, as GGML rounds them: the dimension whose wavelength
    turns beta times in the original context, floor for beta_fast and ceil for beta_slow, within the head."""
    def dim(beta: float) -> float:
        return n_dims * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


@lru_cache(maxsize=16)
def rope_table(cfg: ModelConfig, n_ctx: int, xp: Any, dtype: Any = None) -> tuple[Array, Array]:
    """cos and signed sin for every position and every dim of a head, each [n_ctx, 1, head_dim]
    (broadcast over heads), laid out for ``apply_rope``; dims past rope_dims get cos 1 and sin 0.
    Angles are float64, the table xp's compute type unless `dtype` says otherwise.

    Made once per config, context size, array module and dtype, so a decode step on the GPU uploads
    nothing.
    """
    positions = np.arange(n_ctx, dtype=np.float64)
    angles = positions[:, None] * rope_inv_freq(cfg)[None, :]              # [n_ctx, rope_dims/2]
    cos, sin = np.ones((n_ctx, cfg.head_dim)), np.zeros((n_ctx, cfg.head_dim))
    first, second = _rope_pairs(cfg)
    cos[:, first], cos[:, second] = np.cos(angles), np.cos(angles)
    sin[:, first], sin[:, second] = -np.sin(angles), np.sin(angles)
    if cfg.rope_mscale != 1.0:  # YaRN's: the rotated dims only, as GGML scales them
        cos[:, :cfg.rope_dims] *= cfg.rope_mscale
        sin[:, :cfg.rope_dims] *= cfg.rope_mscale
    dtype = dtype or compute_dtype(xp)
    return xp.asarray(cos[:, None, :], dtype=dtype), xp.asarray(sin[:, None, :], dtype=dtype)


def _rope_pairs(cfg: ModelConfig) -> tuple[slice, slice]:
    """The first and second members of the rotated pairs: adjacent dims (2i, 2i+1) in GGML's normal
    mode, dims (i, i + n/2) in NeoX mode."""
    n = cfg.rope_dims
    if cfg.rope_mode == ROPE_NORMAL:
        return slice(0, n, 2), slice(1, n, 2)
    return slice(0, n // 2), slice(n // 2, n)


@by_rows(1)
def apply_rope(cfg: ModelConfig, x: Array, cos: Array, sin: Array) -> Array:
    """Rotate each pair (a, b) of x [T, heads, head_dim] by its angle: (a cos - b sin, b cos + a sin).

    Written as x * cos + partner(x) * sin with the signed sin of ``rope_table``: a few whole-array
    operations instead of strided writes, which is what costs on the GPU at decode.
    """
    xp = get_array_module(x)
    n = cfg.rope_dims
    if cfg.rope_mode == ROPE_NORMAL:  # swap adjacent dims (those past n are swapped too, times sin 0)
        partner = x.reshape(*x.shape[:-1], -1, 2)[..., ::-1].reshape(x.shape)
    else:                             # swap the two halves of the rotated dims
        partner = xp.concatenate([x[..., n // 2:n], x[..., :n // 2], x[..., n:]], axis=-1)
    return x * cos + partner * sin

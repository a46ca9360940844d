"""pebble_attend_prompt (Kernels.attend_prompt): a prompt chunk's causal attention over one sequence's
caches, on the host library (flash-attention style: tiles of queries, blocks of keys, a running softmax)
and the stub (the model's own numpy attention), against a float64 reference: every KV type, grouped
heads, a sliding window, soft-capped scores, chunks that start past position 0, head widths that take
the SIMD loops and one that takes the portable ones; malformed calls refused by name. The cuda library
refuses the call, saying so."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import store_backend_params
from pyplugin.errors import InvalidArgumentError, PebblingError, SizeMismatchError
from pyplugin.kv_types import KV_TYPES, decode, encode
from pyplugin.store import backend_named


@pytest.fixture(params=store_backend_params(("host", "stub")))
def kernels(request):
    return backend_named(request.param).kernels


def reference(q, k, v, pos, scale, softcap, window, sinks=None) -> np.ndarray:
    """[T, n_head * head_dim] float64: query t (at pos + t) over the keys it sees, head h reading KV head
    h // group; a sink (gpt-oss) one more score of the softmax, weighting no value."""
    T, n_head, hd = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((T, n_head, hd))
    for t in range(T):
        p = pos + t
        first = max(0, p - window + 1) if window else 0
        for h in range(n_head):
            keys, values = k[first:p + 1, h // group].astype(np.float64), v[first:p + 1, h // group].astype(np.float64)
            scores = keys @ (q[t, h] * np.float32(scale)).astype(np.float64)
            if softcap:
                scores = np.tanh(scores / softcap) * softcap
            sink = -np.inf if sinks is None else float(sinks[h])
            w = np.exp(scores - max(scores.max(), sink))
            out[t, h] = (w / (w.sum() + np.exp(sink - max(scores.max(), sink)))) @ values
    return out.reshape(T, -1)


CASES = [  # (n_head, n_kv, head_dim, kv type, T, pos, window, softcap)
    (4, 4, 64, "f16", 70, 0, 0, 0.0),       # one head per KV head; tiles of 64 rows and a part
    (8, 2, 128, "f16", 45, 37, 0, 0.0),     # grouped; a chunk after an earlier one
    (12, 2, 128, "f32", 33, 0, 0, 0.0),     # six query heads per KV head (Qwen2.5's grouping)
    (4, 1, 256, "f16", 50, 10, 16, 0.0),    # Gemma 3's head width, a sliding window narrower than the chunk
    (8, 4, 64, "q8_0", 40, 5, 0, 3.0),      # a block type, soft-capped scores
    (8, 4, 64, "q4_0", 40, 0, 7, 0.0),
    (6, 3, 24, "f16", 29, 3, 0, 0.0),       # 24 wide: not a multiple of 16, the portable loops
    (2, 2, 80, "f32", 3, 90, 0, 0.0),       # 80 wide (16s, not 32s); a short chunk late in the cache
]
SINK_CASES = [  # gpt-oss's: 64 wide, eight query heads a KV head, every other layer a window of 128 (here 9)
    (16, 2, 64, "f16", 40, 0, 0, 0.0), (16, 2, 64, "f32", 30, 12, 9, 0.0), (6, 3, 24, "f16", 20, 3, 0, 0.0)]


@pytest.mark.parametrize("n_head,n_kv,head_dim,kv,T,pos,window,softcap", CASES + SINK_CASES)
def test_prompt_attention_matches_the_reference(kernels, n_head, n_kv, head_dim, kv, T, pos, window, softcap):
    rng = np.random.default_rng(head_dim + T + pos)
    rows, t = pos + T + 5, KV_TYPES[kv]
    q = rng.standard_normal((T, n_head, head_dim)).astype(np.float32)
    k_cache, v_cache = (encode(rng.standard_normal((rows, n_kv, head_dim)).astype(np.float32) * 2, t) for _ in range(2))
    scale = 1 / np.sqrt(head_dim)
    xp = kernels.xp
    sinks = rng.standard_normal(n_head).astype(np.float32) * 3 if (n_head, n_kv, head_dim, kv, T, pos, window,
                                                                 softcap) in SINK_CASES else None
    got = kernels.attend_prompt(xp.asarray(q), (xp.asarray(k_cache), xp.asarray(v_cache)), pos, n_kv, scale,
                                softcap, window, None if sinks is None else xp.asarray(sinks))
    assert got.shape == (T, n_head * head_dim) and got.dtype == np.float32
    want = reference(q, decode(k_cache, t), decode(v_cache, t), pos, scale, softcap, window, sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    if sinks is not None:  # the sinks take probability away: not dead
        assert np.abs(reference(q, decode(k_cache, t), decode(v_cache, t), pos, scale, softcap, window) - want).max() > 1e-2


def test_a_chunk_is_each_query_attending_alone(kernels):
    """Split into chunks, or one query at a time, the rows come out as in one call (to float32 rounding)."""
    rng = np.random.default_rng(7)
    n_head, n_kv, hd, T = 8, 2, 64, 48
    q = rng.standard_normal((T, n_head, hd)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((T, n_kv, hd)).astype(np.float16) for _ in range(2))
    whole = np.asarray(kernels.attend_prompt(q, (k_cache, v_cache), 0, n_kv, 0.125))
    parts = np.concatenate([np.asarray(kernels.attend_prompt(q[a:a + 16], (k_cache, v_cache), a, n_kv, 0.125))
                            for a in range(0, T, 16)])
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)
    one = np.asarray(kernels.attend(q[T - 1:], [(k_cache, v_cache)], [T], n_kv, 0.125))
    np.testing.assert_allclose(one[0], whole[T - 1], rtol=1e-5, atol=1e-6)


def test_malformed_calls_are_refused_by_name(kernels):
    q = np.zeros((4, 4, 32), np.float32)
    cache = (np.zeros((6, 2, 32), np.float16), np.zeros((6, 2, 32), np.float16))
    with pytest.raises(SizeMismatchError, match=r"positions 3\.\.6 .* hold 6"):
        kernels.attend_prompt(q, cache, 3, 2, 1.0)
    with pytest.raises(InvalidArgumentError, match="4 query heads cannot share 3 KV heads"):
        kernels.attend_prompt(q, cache, 0, 3, 1.0)
    with pytest.raises(InvalidArgumentError, match="window -1 at least 0"):
        kernels.attend_prompt(q, cache, 0, 2, 1.0, window=-1)
    with pytest.raises(InvalidArgumentError, match="softcap"):
        kernels.attend_prompt(q, cache, 0, 2, 1.0, softcap=-1.0)
    odd = tuple(np.zeros((6, 2, 32), np.int16) for _ in range(2))
    with pytest.raises(InvalidArgumentError, match="attend_prompt"):
        kernels.attend_prompt(q, odd, 0, 2, 1.0)


@pytest.mark.parametrize("backend", store_backend_params(("cuda",)))
def test_the_cuda_library_says_it_does_not_attend_prompts(backend):
    kernels = backend_named(backend).kernels
    xp = kernels.xp
    q = xp.zeros((4, 4, 32), np.float32)
    cache = (xp.zeros((6, 2, 32), np.float16), xp.zeros((6, 2, 32), np.float16))
    with pytest.raises(PebblingError, match="does not attend prompts yet"):
        kernels.attend_prompt(q, cache, 0, 2, 1.0)

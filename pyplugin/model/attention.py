"""Causal grouped-query attention over a KV cache, as the forward pass computes it (numpy or CuPy), with a
long prompt's queries split among the host's threads; and gemma2's soft cap of scores and logits.
"""

from __future__ import annotations

import functools
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import numpy as np

from ..xp import get_array_module

Array = Any
ModelConfig = Any  # pyplugin.model.transformer.ModelConfig (a layer's own), which imports this module


def softcap(x: Array, cap: float) -> Array:
    """c * tanh(x / c): gemma2's soft cap (identity when cap is 0)."""
    if cap <= 0:
        return x
    xp = get_array_module(x)
    return xp.tanh(x / cap) * cap


def attention(cfg: ModelConfig, q: Array, k: Array, v: Array, pos: int, k_pos: int = 0,
              sinks: Array | None = None) -> Array:
    """Causal grouped-query attention of T queries at positions pos.. over S keys at k_pos..k_pos+S.

    q [T, n_head, head_dim]; k, v [S, n_head_kv, head_dim]. A query at p sees the keys at p and before,
    and on a sliding layer (cfg.window) only the last window of them, as llama.cpp masks them. Query
    head h reads KV head h // n_group, as GGML broadcasts it. `sinks` [n_head] (gpt-oss): a learned
    logit per head that joins each softmax's denominator (and its maximum) and weights no value, as
    GGML's soft_max with sinks computes it; not scaled. Returns [T, n_head * head_dim].

    Host arrays of a long prompt are split by queries among threads (numpy releases the GIL in its
    products and ufuncs; its BLAS is held to one thread beside the host library's pool): each part
    gets the keys its queries see, the parts cut so that each has about as many scores to compute.
    """
    xp = get_array_module(q)
    T, S = q.shape[0], k.shape[0]
    threads = _attention_threads() if xp is np else 1
    if threads < 2 or T < 2 * threads or T * S * cfg.n_head < _SPLIT_SCORES:
        return _attention(cfg, q, k, v, pos, k_pos, sinks)
    p = pos + np.arange(T)
    first = np.maximum(k_pos, p - cfg.window + 1) if cfg.window else np.full(T, k_pos)
    cost = np.cumsum(np.minimum(p + 1, k_pos + S) - first)
    cuts = [0, *np.searchsorted(cost, cost[-1] * np.arange(1, threads) / threads).tolist(), T]
    parts = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

    def part(a: int, b: int) -> Array:
        lo, hi = int(first[a]), min(pos + b, k_pos + S)  # the keys that queries a..b-1 see
        return _attention(cfg, q[a:b], k[lo - k_pos:hi - k_pos], v[lo - k_pos:hi - k_pos], pos + a, lo, sinks)

    futures = [_attention_pool().submit(part, a, b) for a, b in parts[1:]]
    out = [part(*parts[0]), *(f.result() for f in futures)]
    return np.concatenate(out)


_SPLIT_SCORES = 1 << 20  # below this many scores, one thread: a split costs more than it saves


def by_rows(arg: int = 0):
    """A row-wise function of host arrays, computed in parts of rows on the host's threads where its
    array is large (a prefill chunk's norms, rotations and gates, which numpy runs on one core while the
    matrices around them use them all; its ufuncs release the GIL). Argument `arg` is the array whose
    rows are split; every other array argument of its dimensions and rows is split alike. Each part's
    rows are computed as the whole call computes them, so the result is the same bit for bit."""
    def wrap(fn):
        @functools.wraps(fn)
        def rowwise(*args, **kwargs):
            x = args[arg]
            threads = _attention_threads() if type(x) is np.ndarray and x.ndim >= 2 else 1
            T = x.shape[0] if threads > 1 else 0
            if threads < 2 or T < 4 * threads or x.size < _SPLIT_ELEMENTS:
                return fn(*args, **kwargs)
            split = [i for i, a in enumerate(args)
                     if type(a) is np.ndarray and a.ndim == x.ndim and a.shape[0] == T]
            cuts = np.linspace(0, T, 4 * threads + 1).astype(int).tolist()

            def part(a: int, b: int):
                return fn(*(v[a:b] if i in split else v for i, v in enumerate(args)), **kwargs)

            first = part(cuts[0], cuts[1])
            out = np.empty((T, *first.shape[1:]), dtype=first.dtype)
            out[:cuts[1]] = first

            parts = itertools.count(1)  # the parts left, taken by whichever thread is free (next() holds the GIL)

            def work() -> None:
                while (k := next(parts)) < len(cuts) - 1:
                    out[cuts[k]:cuts[k + 1]] = part(cuts[k], cuts[k + 1])

            futures = [_attention_pool().submit(work) for _ in range(threads - 1)]
            work()
            for f in futures:
                f.result()
            return out
        return rowwise
    return wrap


_SPLIT_ELEMENTS = 1 << 17  # below this many elements, one thread


@lru_cache(maxsize=1)
def _attention_threads() -> int:
    """The host library's thread count (PEBBLING_THREADS, else the CPUs this process may run on)."""
    try:
        return max(1, min(256, int(os.environ.get("PEBBLING_THREADS", "")) or 1))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@lru_cache(maxsize=1)
def _attention_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, _attention_threads() - 1), thread_name_prefix="pebbling-attention")


def _attention(cfg: ModelConfig, q: Array, k: Array, v: Array, pos: int, k_pos: int, sinks: Array | None) -> Array:
    xp = get_array_module(q)
    T, S, G = q.shape[0], k.shape[0], cfg.n_group
    q = q * cfg.query_scale
    qg = q.reshape(T, cfg.n_head_kv, G, cfg.head_dim).transpose(1, 2, 0, 3)    # [n_kv, G, T, hd]
    qg = qg.reshape(cfg.n_head_kv, G * T, cfg.head_dim)                         # [n_kv, G*T, hd]
    scores = qg @ k.transpose(1, 2, 0)                                          # [n_kv, G*T, S]
    scores = softcap(scores.astype(np.float32, copy=False), cfg.attn_softcap).reshape(cfg.n_head_kv, G, T, S)
    q_at, k_at = pos + xp.arange(T)[:, None], k_pos + xp.arange(S)[None, :]
    hidden = k_at > q_at if T > 1 or k_pos + S > pos + T else None             # [T, S]: the future
    if cfg.window and (T > 1 or S > cfg.window):
        outside = q_at - k_at >= cfg.window                                     # out of the window
        hidden = outside if hidden is None else hidden | outside
    if hidden is not None:
        xp.copyto(scores, -np.inf, where=hidden)
    top = scores.max(axis=-1, keepdims=True)                                    # [n_kv, G, T, 1]
    if sinks is not None:
        sink = xp.asarray(sinks, dtype=np.float32).reshape(cfg.n_head_kv, G, 1, 1)
        top = xp.maximum(top, sink)
    scores -= top
    probs = xp.exp(scores, out=scores)
    total = probs.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += xp.exp(sink - top)
    probs /= total
    probs = probs.astype(v.dtype, copy=False).reshape(cfg.n_head_kv, G * T, S)
    out = probs @ v.transpose(1, 0, 2)                                          # [n_kv, G*T, hd]
    out = out.reshape(cfg.n_head_kv, G, T, cfg.head_dim).transpose(2, 0, 1, 3)  # [T, n_kv, G, hd]
    return out.reshape(T, cfg.n_head * cfg.head_dim)


# ---------------------------------------------------------------------------------------------------
# the three steps of a forward pass

"""top_k: the k largest logits found among a pool bounded by block maxima (sampling.top_k_candidates), held
to a full sort by (-logit, id) on every shape of logits a model or a constraint makes."""

from __future__ import annotations

import numpy as np
import pytest

from pyplugin.runtime import sampling
from pyplugin.runtime.options import Options
from pyplugin.runtime.sampling import Sampler, top_k_candidates


def by_sorting(logits: np.ndarray, k: int) -> np.ndarray:
    """The reference: every id sorted by logit, largest first, equal logits lowest id first."""
    order = np.lexsort((np.arange(logits.size), -logits))
    return order if not 0 < k < logits.size else order[:k]


def logits_of(kind: str, n: int, rng) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n)
    if kind == "few values":  # ties everywhere, across the k-th largest too
        return rng.integers(-3, 3, n).astype(np.float64)
    if kind == "equal":
        return np.zeros(n)
    if kind == "masked":  # a constraint's mask: fewer allowed tokens than k, the rest -inf
        out = np.full(n, -np.inf)
        out[rng.integers(0, n, 7)] = rng.standard_normal(7)
        return out
    if kind == "ascending":  # every block's maximum at its end: the bound lets most through
        return np.sort(rng.standard_normal(n))
    out = rng.standard_normal(n)  # "+inf": a vanishing repeat penalty's
    out[rng.integers(0, n, 3)] = np.inf
    return out


KINDS = ("normal", "few values", "equal", "masked", "ascending", "+inf")


@pytest.mark.parametrize("n", [10, 5000, 32000, 128256, 151936])
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_is_a_full_sorts_first_k(n, kind):
    """Vocabularies below and above the blocks' use (10 has none; 128256 and 151936 are not whole blocks:
    their last logits are past every block), k from 1 to past the vocabulary, float32 and float64."""
    rng = np.random.default_rng(n + KINDS.index(kind))
    logits = logits_of(kind, n, rng)
    for dtype in (np.float32, np.float64):
        x = logits.astype(dtype)
        for k in (0, 1, 5, 40, 100, sampling.TOP_K_BLOCKS, sampling.TOP_K_BLOCKS + 1, n - 1, n, n + 5):
            np.testing.assert_array_equal(top_k_candidates(x, k), by_sorting(x, k), err_msg=f"k={k} {dtype}")


def test_the_largest_logit_past_the_last_whole_block_is_found():
    """128256 logits make 1024 blocks of 125 and 256 left over: the largest of all among those."""
    logits = np.random.default_rng(1).standard_normal(128256)
    logits[-1] = 50.0
    logits[-200] = 40.0
    assert list(top_k_candidates(logits, 2)) == [128255, 128056]


def test_a_models_logits_are_ranked_within_a_small_pool():
    """What makes it fast: on a spread of logits the pool is a few hundred of 128256, not the vocabulary."""
    logits = np.random.default_rng(2).standard_normal(128256).astype(np.float32)
    pool = sampling._pool(logits, 40)
    assert pool is not None and 40 <= pool.size <= 2000
    assert set(by_sorting(logits, 40)) <= set(pool)


def test_nan_logits_rank_below_every_number_as_numpy_sorts_them():
    """A NaN (a broken model's) ranks below every number (numpy sorts NaN last); nothing is lost or raised."""
    logits = np.random.default_rng(3).standard_normal(5000)
    logits[[10, 20]] = np.nan
    as_lowest = np.where(np.isnan(logits), -np.inf, logits)
    np.testing.assert_array_equal(top_k_candidates(logits, 4), by_sorting(as_lowest, 4))
    np.testing.assert_array_equal(top_k_candidates(logits, 4999)[:4998], by_sorting(as_lowest, 4998))  # then a NaN


def test_a_seeded_draw_is_the_same_token_each_time():
    logits = np.random.default_rng(4).standard_normal(128256).astype(np.float32)
    draws = [Sampler(Options(seed=42, temperature=0.8, top_k=40, top_p=0.9))(logits, [1, 2, 3]) for _ in range(3)]
    assert len(set(draws)) == 1 and draws[0] in set(by_sorting(logits, 40))


def test_without_top_k_the_kept_tokens_and_probabilities_are_the_full_orders():
    """nucleus ranks only as many of the largest as top_p and min_p look at: what they keep is the head of
    the whole vocabulary's order (by probability, lowest id first among equals), the same probabilities,
    on peaked and flat logits, ties, and every temperature, top_p and min_p mix."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        n = int(rng.integers(10, 160000))
        logits = rng.standard_normal(n) * float(rng.choice([0.1, 1.0, 3.0, 30.0]))
        if trial % 5 == 0:
            logits = np.round(logits)
        t, p, min_p = (float(rng.choice(c)) for c in ([0.2, 0.8, 2.0], [0.5, 0.9, 0.999], [0.0, 0.0, 0.01, 0.1]))
        ids, probs = sampling.nucleus(logits, t, p, min_p)
        keep = min(sampling.top_p_count(probs, p), sampling.min_p_count(probs, min_p))
        order = by_sorting(logits, 0)
        whole = sampling.softmax(logits, t)[order]
        want = min(sampling.top_p_count(whole, p), sampling.min_p_count(whole, min_p))
        assert keep == want, (trial, n, t, p, min_p)
        np.testing.assert_array_equal(ids[:keep], order[:keep])
        np.testing.assert_array_equal(probs[:keep], whole[:keep])


def test_without_top_k_top_p_or_min_p_every_token_is_drawn_by_its_probability():
    """Nothing cut: no ranking, every id in order with its probability; a seeded draw's frequencies follow."""
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    ids, probs = sampling.nucleus(logits, 1.0, 1.0, 0.0)
    assert list(ids) == [0, 1, 2] and np.allclose(probs, [0.5, 0.3, 0.2])
    sampler = Sampler(Options(seed=1, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0))
    counts = np.bincount([sampler(logits) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def test_a_draw_over_blocks_is_the_draw_over_the_whole_running_sum():
    """draw's two levels (DRAW_BLOCK blocks' sums, then one block) pick the index the whole running sum picks,
    over vocabularies of a partial last block, zeros (masked tokens) between and at the ends, and a single
    token holding all the mass; and u near 0 and 1."""
    rng = np.random.default_rng(9)
    for n in (10, 4096, 4097, 128256, 151936):
        for kind in ("random", "zeros", "one"):
            p = rng.random(n) ** 8
            if kind == "zeros":
                p[rng.random(n) < 0.7] = 0.0
                p[:3] = p[-3:] = 0.0
            elif kind == "one":
                p = np.zeros(n)
                p[n // 3] = 1.0
            for u in [0.0, 1e-12, 1 - 1e-12, *rng.random(200)]:
                mass = np.cumsum(p)
                want = min(int(np.searchsorted(mass, u * mass[-1], side="right")), n - 1)
                got = sampling.draw(p, u)
                assert got == want or abs(mass[got] - u * mass[-1]) < 1e-9 * mass[-1], (n, kind, u, got, want)
                assert p[got] > 0, (n, kind, u, got)


def test_a_draw_over_no_mass_or_nan_still_names_a_token():
    """Logits that give no usable mass (NaN throughout, or every probability zero) never raise: a draw is
    an index of the vocabulary whatever the arithmetic left."""
    for n in (10, 5000, 128256):
        for p in (np.zeros(n), np.full(n, np.nan)):
            assert 0 <= sampling.draw(p, 0.5) < n
    assert 0 <= Sampler(Options(top_k=0, top_p=1.0))(np.full(4096, np.nan, dtype=np.float32), []) < 4096

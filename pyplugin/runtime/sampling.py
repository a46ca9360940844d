"""Choosing the next token from logits, in llama.cpp's order:
repeat penalty -> (greedy at temperature 0) -> top_k -> temperature -> softmax -> top_p -> min_p -> draw;
with mirostat 1 or 2, as llama.cpp's sampler chain has it: temperature -> Mirostat -> draw, Mirostat taking
the place of the penalties, top_k, top_p and min_p.

Each request owns a numpy Generator, so a seed makes a run reproducible whatever else runs beside it, and
its Mirostat state (mu), so that concurrent requests never steer each other.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from .options import Options


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """Make recently seen tokens less likely: positive logits are divided by the penalty, negative
    ones multiplied (llama.cpp's rule, so a penalty never raises a token). Returns a float64 copy, so
    that no penalty in the accepted range overflows."""
    logits = np.array(logits, dtype=np.float64)
    if penalty == 1.0 or not len(recent):
        return logits
    distinct = set(recent)  # a token seen twice is penalised once; a set of 64 ids beats np.unique's sort
    seen = np.fromiter(distinct, dtype=np.int64, count=len(distinct))
    values = logits[seen]
    with np.errstate(over="ignore"):  # a penalty near 0 sends positive logits to inf: see softmax
        logits[seen] = np.where(values > 0, values / penalty, values * penalty)
    return logits


def apply_presence_frequency(logits: np.ndarray, recent: Sequence[int], presence: float,
                             frequency: float) -> np.ndarray:
    """llama.cpp's (and so Ollama's) penalties: a token seen c times among the recent ones loses
    c * frequency + presence from its logit. Returns a float64 copy."""
    logits = np.array(logits, dtype=np.float64)
    if len(recent):
        ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        logits[ids] -= counts * frequency + presence
    return logits


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first, equal logits lowest id first (all ids when k is 0 or
    beyond the vocabulary).

    A partition of a whole 128k vocabulary took 1.2-2.3 ms a token on this project's 2-core test machine
    (numpy's introselect: most of a step's sampling). So the k-th largest is looked for among few logits
    where it can be: of the vocabulary in TOP_K_BLOCKS blocks, at least k blocks' maxima reach the k-th
    largest of the maxima, so at least k logits do, and so does each of the k largest; the logits that
    reach it are the pool. Where it lets too many through (logits mostly equal, or masked to -inf), the
    pool is the vocabulary."""
    n = logits.size
    if not 0 < k < n:
        return _largest_first(logits, np.arange(n))
    pool = _pool(logits, k)
    values = logits if pool is None else logits[pool]
    kth = np.partition(values, values.size - k)[values.size - k]
    above = np.flatnonzero(values > kth)
    chosen = np.concatenate([above, np.flatnonzero(values == kth)[:k - above.size]])  # ties: the lowest ids
    if chosen.size < k:  # a NaN, which partition puts above every number: numpy's sort, which puts it last
        ids = np.argpartition(-logits, k - 1)[:k]
        return ids[np.argsort(-logits[ids], kind="stable")]
    chosen = np.sort(chosen if pool is None else pool[chosen])
    return _largest_first(logits, chosen)


TOP_K_BLOCKS = 1024  # blocks of the vocabulary whose maxima bound the k-th largest logit from below
TOP_K_POOL = 8192    # a pool larger than this is the whole vocabulary (the bound let too many through)


def _pool(logits: np.ndarray, k: int) -> np.ndarray | None:
    """Ascending ids of a few logits among which are the k largest (see top_k_candidates), or None."""
    width = logits.size // TOP_K_BLOCKS
    if k > TOP_K_BLOCKS or width < 8:
        return None
    maxima = logits[:width * TOP_K_BLOCKS].reshape(TOP_K_BLOCKS, width).max(axis=1)
    bound = np.partition(maxima, TOP_K_BLOCKS - k)[TOP_K_BLOCKS - k]
    pool = np.flatnonzero(logits >= bound)  # the logits past the last whole block are held to it too
    return pool if k <= pool.size <= TOP_K_POOL else None


def _largest_first(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Ascending `ids` ordered by their logits, largest first; equal logits keep their order (NaN last)."""
    return ids[np.argsort(-logits[ids], kind="stable")]


def softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(x / temperature), for any temperature above 0 and logits up to +inf."""
    top = np.max(x)
    if np.isposinf(top):  # a vanishing repeat penalty sent some logits to +inf: they share all the mass
        e = (np.asarray(x) == top).astype(np.float64)
    else:  # shifted first, so a vanishing temperature sends the others to -inf and never the top to +inf
        e = np.subtract(x, top, dtype=np.float64)  # in one new array, each step in place (a 128k vocabulary)
        with np.errstate(over="ignore"):
            if temperature != 1.0:
                e /= temperature
            np.exp(e, out=e)
    e /= e.sum()
    return e


def top_p_count(probs: np.ndarray, p: float) -> int:
    """How many of the (descending) probs make the smallest set whose mass reaches p (at least 1)."""
    if p >= 1.0:
        return probs.size
    return int(min(np.searchsorted(np.cumsum(probs), p) + 1, probs.size))


def min_p_count(probs: np.ndarray, min_p: float) -> int:
    """How many of the (descending) probs are at least min_p times the largest (at least 1)."""
    if min_p <= 0.0:
        return probs.size
    return max(1, int(np.count_nonzero(probs >= min_p * probs[0])))


def nucleus(logits: np.ndarray, temperature: float, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Without top_k: every token's probability, in descending order as far as top_p and min_p look (ids,
    probs). Sorting a 128k vocabulary took 18 ms a token on this project's 2-core test machine, so the
    largest NUCLEUS_FIRST are ranked first (top_k_candidates), then four times as many, until they hold
    top_p's mass or a token below min_p times the largest: what top_p_count and min_p_count read of them
    is then what they would read of the whole order; past an eighth of the vocabulary, the whole order.
    With top_p 1 and no min_p nothing is cut, and the draw needs no order: every token, in id order."""
    probs = softmax(logits, temperature)
    if top_p >= 1.0 and min_p <= 0.0:
        return _every_id(logits.size), probs
    m = NUCLEUS_FIRST
    while m <= logits.size // 8:
        ids = top_k_candidates(logits, m)
        head = probs[ids]
        if (top_p < 1.0 and np.cumsum(head)[-1] >= top_p) or (min_p > 0.0 and head[-1] < min_p * head[0]):
            return ids, head
        m *= 4
    ids = top_k_candidates(logits, 0)
    return ids, probs[ids]


NUCLEUS_FIRST = 256  # the largest probabilities nucleus ranks first


@functools.lru_cache(maxsize=2)
def _every_id(n: int) -> np.ndarray:
    """0..n-1, read-only, made once per vocabulary size (new each token, its pages cost more than the draw)."""
    ids = np.arange(n)
    ids.flags.writeable = False
    return ids


DRAW_BLOCK = 1024  # draw's blocks: their sums, then one block's running sum, instead of a 128k running sum


def draw(probs: np.ndarray, u: float) -> int:
    """The first index whose running sum of probs exceeds u times their total (u in [0, 1)): the running sum
    of DRAW_BLOCK blocks' sums finds the block, and that block's own running sum the index."""
    if probs.size <= 4 * DRAW_BLOCK:
        return _first_past(probs, np.cumsum(probs), u * np.sum(probs))
    whole = probs.size // DRAW_BLOCK * DRAW_BLOCK
    sums = np.append(probs[:whole].reshape(-1, DRAW_BLOCK).sum(axis=1), probs[whole:].sum())
    blocks = np.cumsum(sums)
    target = u * blocks[-1]
    b = min(int(np.searchsorted(blocks, target, side="right")), _last_nonzero(sums))
    block = probs[b * DRAW_BLOCK:(b + 1) * DRAW_BLOCK]
    return b * DRAW_BLOCK + _first_past(block, np.cumsum(block) + (blocks[b - 1] if b else 0.0), target)


def _first_past(probs: np.ndarray, running: np.ndarray, target: float) -> int:
    """The first index whose running sum exceeds target; where rounding leaves none, the last of a nonzero
    probability (never a token the cut or a mask gave nothing)."""
    i = int(np.searchsorted(running, target, side="right"))
    return i if i < probs.size else _last_nonzero(probs)


def _last_nonzero(values: np.ndarray) -> int:
    """The last index of a nonzero value (NaN counts), else the last index."""
    found = np.flatnonzero(values)
    return int(found[-1]) if found.size else values.size - 1


# ---------------------------------------------------------------------------------------------------
# Mirostat (Basu et al., 2021), as llama.cpp's llama_sampler_init_mirostat and _mirostat_v2 compute it: each
# step truncates the distribution so that the token drawn is about as surprising as the target tau (in
# bits, -log2 p), then moves its threshold mu by eta times the error. Summed over N steps the updates say
# mean(surprise) - tau = (mu_0 - mu_N) / (eta * N): the observed surprise tracks tau as long as mu stays
# bounded. "Surprise" is that of the token under the truncated distribution it was drawn from, as
# llama.cpp measures it.

MIROSTAT_M = 100  # llama.cpp's m: Mirostat 1 estimates the Zipf exponent from the m most probable tokens


def zipf_exponent(head: np.ndarray) -> float:
    """Mirostat 1's estimate s_hat of the Zipf exponent from the descending probabilities `head` (least
    squares of log(p_i / p_i+1) on log((i+2)/(i+1)), as llama.cpp). Tokens a grammar masked (probability 0)
    are left out; fewer than two left: inf (everything on one token)."""
    p = head[head > 0]
    if p.size < 2:
        return math.inf
    i = np.arange(p.size - 1)
    t = np.log((i + 2) / (i + 1))
    b = np.log(p[:-1] / p[1:])
    return float(np.dot(t, b) / np.dot(t, t))


def mirostat_k(s_hat: float, mu: float, n_vocab: int) -> int:
    """How many of the most probable tokens Mirostat 1 keeps: k = (eps 2^mu / (1 - N^-eps))^(1/s_hat) with
    eps = s_hat - 1 (llama.cpp's formula; at eps 0 its limit, 2^mu / ln N), within 1..N."""
    if not math.isfinite(s_hat) or s_hat <= 0:
        return 1 if not math.isfinite(s_hat) else n_vocab  # one token holds it all; or a flat head
    eps = s_hat - 1.0
    try:
        base = 2.0 ** mu / math.log(n_vocab) if abs(eps) < 1e-9 else eps * 2.0 ** mu / (1.0 - n_vocab ** -eps)
        k = base ** (1.0 / s_hat) if base > 0 else 1.0
    except OverflowError:
        return n_vocab
    return int(min(max(k, 1.0), n_vocab)) if math.isfinite(k) else n_vocab


def mirostat_candidates(logits: np.ndarray, version: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probabilities renormalized over them) of the tokens Mirostat `version` keeps at threshold `mu`
    from `logits` (already divided by the temperature)."""
    probs = softmax(logits)
    if version == 1:
        head = probs[top_k_candidates(logits, min(MIROSTAT_M, logits.size))]
        ids = top_k_candidates(logits, mirostat_k(zipf_exponent(head), mu, logits.size))
    else:  # Mirostat 2: every token whose surprise is at most mu, else the most probable one
        ids = np.flatnonzero(probs >= 2.0 ** -mu)
        if ids.size == 0:
            ids = np.array([int(np.argmax(probs))])
    kept = probs[ids]
    return ids, kept / kept.sum()


class Sampler:
    """Picks tokens for one request."""

    def __init__(self, options: Options):
        self.options = options
        self.rng = np.random.default_rng(options.seed)
        self.mu = 2.0 * options.mirostat_tau  # Mirostat's threshold, in bits; llama.cpp starts it at 2 tau
        self.surprise: float | None = None    # the last Mirostat step's observed surprise, in bits

    def recent(self, history: Sequence[int]) -> Sequence[int]:
        n = self.options.repeat_last_n
        n = self.options.num_ctx if n == -1 else n
        return history[-n:] if n > 0 else ()

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        o = self.options
        if o.mirostat:
            return self.mirostat(logits)
        recent = self.recent(history)
        logits = apply_repeat_penalty(logits, recent, o.repeat_penalty)
        if o.presence_penalty or o.frequency_penalty:
            logits = apply_presence_frequency(logits, recent, o.presence_penalty, o.frequency_penalty)
        if o.temperature <= 0.0:
            return int(np.argmax(logits))
        if 0 < o.top_k < logits.size:
            ids = top_k_candidates(logits, o.top_k)
            probs = softmax(logits[ids], o.temperature)
        else:
            ids, probs = nucleus(logits, o.temperature, o.top_p, o.min_p)
        keep = min(top_p_count(probs, o.top_p), min_p_count(probs, o.min_p))
        return int(ids[draw(probs[:keep], self.rng.random())])  # scaled by the kept mass, not divided by it

    def mirostat(self, logits: np.ndarray) -> int:
        """One Mirostat step: temperature, truncation at mu, a draw, mu moved by eta times the surprise's
        error. At temperature 0 the most probable token, as llama.cpp's temperature sampler leaves only it."""
        o = self.options
        if o.temperature <= 0.0:
            return int(np.argmax(logits))
        scaled = np.asarray(logits, dtype=np.float64) / o.temperature
        ids, probs = mirostat_candidates(scaled, o.mirostat, self.mu)
        i = draw(probs, self.rng.random())
        self.surprise = -math.log2(probs[i])
        self.mu -= o.mirostat_eta * (self.surprise - o.mirostat_tau)
        return int(ids[i])

"""pebble_attend (Kernels.attend): one query per sequence over a cache of its own, every sequence of a
batch in one call, on every backend: against a float64 reference, each sequence the same whatever the
others beside it, and malformed calls refused with errors that name what was wrong."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import store_backend_params
from pyplugin.errors import InvalidArgumentError, SizeMismatchError
from pyplugin.store import backend_named

N_ROWS, N_HEAD, N_KV, HEAD_DIM = 40, 8, 2, 24  # head_dim not a multiple of 16: the SIMD loops' tails run


@pytest.fixture(params=store_backend_params())
def kernels(request):
    return backend_named(request.param).kernels


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def reference(q, k, v, n, scale, softcap) -> np.ndarray:
    """[n_head * head_dim] float64: softmax((q * scale) . k) over rows 0..n-1, query head h reading KV
    head h // (n_head // n_kv) (q [n_head, head_dim], k and v [rows, n_kv, head_dim]), soft-capped where asked."""
    n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    out = np.empty((n_head, head_dim))
    for h in range(n_head):
        keys, values = k[:n, h // group].astype(np.float64), v[:n, h // group].astype(np.float64)
        scores = keys @ (q[h].astype(np.float32) * np.float32(scale)).astype(np.float64)
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        p = np.exp(scores - scores.max())
        out[h] = (p / p.sum()) @ values
    return out.reshape(-1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_each_sequence_attends_over_its_own_rows(kernels, dtype, softcap):
    rng = np.random.default_rng(1)
    xp = kernels.xp
    n_pos = [1, 17, N_ROWS, 5]
    q = rng.standard_normal((len(n_pos), N_HEAD, HEAD_DIM)).astype(np.float32)
    caches = [tuple(rng.standard_normal((N_ROWS, N_KV, HEAD_DIM)).astype(dtype) for _ in range(2)) for _ in n_pos]
    scale = 1 / np.sqrt(HEAD_DIM)
    got = to_host(kernels.attend(xp.asarray(q), [(xp.asarray(k), xp.asarray(v)) for k, v in caches], n_pos, N_KV,
                                 scale, softcap))
    assert got.shape == (len(n_pos), N_HEAD * HEAD_DIM) and got.dtype == np.float32
    for b, ((k, v), n) in enumerate(zip(caches, n_pos)):
        np.testing.assert_allclose(got[b], reference(q[b], k, v, n, scale, softcap), rtol=1e-5, atol=1e-5)
    # alone, each sequence gets exactly what it gets beside the others
    for b, ((k, v), n) in enumerate(zip(caches, n_pos)):
        alone = to_host(kernels.attend(xp.asarray(q[b:b + 1]), [(xp.asarray(k), xp.asarray(v))], [n], N_KV, scale,
                                       softcap))
        np.testing.assert_array_equal(alone[0], got[b])


def test_more_sequences_than_one_launch_takes_each_get_their_own(kernels):
    """Eleven sequences in one call: the GPU launches its attention kernels for eight at a time (a group, the
    sequence in blockIdx.y), so the second group starts at the ninth; each against the reference, and the
    same as alone."""
    rng = np.random.default_rng(7)
    xp = kernels.xp
    n_pos = [1 + (7 * b) % N_ROWS for b in range(11)]
    q = rng.standard_normal((len(n_pos), N_HEAD, HEAD_DIM)).astype(np.float32)
    caches = [tuple(rng.standard_normal((N_ROWS, N_KV, HEAD_DIM)).astype(np.float16) for _ in range(2)) for _ in n_pos]
    got = to_host(kernels.attend(xp.asarray(q), [(xp.asarray(k), xp.asarray(v)) for k, v in caches], n_pos, N_KV, 0.3))
    for b, ((k, v), n) in enumerate(zip(caches, n_pos)):
        np.testing.assert_allclose(got[b], reference(q[b], k, v, n, 0.3, 0.0), rtol=1e-5, atol=1e-5)
    for b in (0, 7, 8, 10):  # either side of the groups' edge
        (k, v), n = caches[b], n_pos[b]
        alone = to_host(kernels.attend(xp.asarray(q[b:b + 1]), [(xp.asarray(k), xp.asarray(v))], [n], N_KV, 0.3))
        np.testing.assert_array_equal(alone[0], got[b])


@pytest.mark.parametrize("n_head, n_kv", [(4, 4), (9, 3), (12, 2), (14, 2), (16, 2), (32, 4)])
def test_every_grouping_of_query_heads_reads_its_own_kv_head(kernels, n_head, n_kv):
    """Query heads per KV head from 1 to 8 (the host library takes up to 6 of a KV head's query heads at
    once on AVX-512, two at once on AVX2: 7 and 8 are split): each head against the float64 reference."""
    rng = np.random.default_rng(n_head)
    xp, n_pos, head_dim = kernels.xp, [N_ROWS, 9], 32
    q = rng.standard_normal((len(n_pos), n_head, head_dim)).astype(np.float32)
    caches = [tuple(rng.standard_normal((N_ROWS, n_kv, head_dim)).astype(np.float16) for _ in range(2)) for _ in n_pos]
    got = to_host(kernels.attend(xp.asarray(q), [(xp.asarray(k), xp.asarray(v)) for k, v in caches], n_pos, n_kv,
                                 1 / np.sqrt(head_dim), 0.0))
    for b, ((k, v), n) in enumerate(zip(caches, n_pos)):
        np.testing.assert_allclose(got[b], reference(q[b], k, v, n, 1 / np.sqrt(head_dim), 0.0), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("kv, head_dim", [("f16", 48), ("q8_0", 64), ("q4_0", 64)])
@pytest.mark.parametrize("n_head, n_kv, softcap", [(8, 2, 0.0), (16, 1, 0.0), (6, 3, 30.0)])
def test_long_contexts_read_in_chunks_give_the_reference(kernels, n_head, n_kv, softcap, kv, head_dim):
    """Contexts of one row to past 128 rows (the host library reads a sequence's rows in chunks of up to 128,
    combined at the end, and a KV head's query heads in runs of up to 8, 6 and 2: 16 heads over one KV head
    are split), sequences of one chunk and of several in one call, caches of fp16 and of blocks: each
    against the float64 reference over the values the cache holds, and each the same, bit for bit, alone
    as beside the others."""
    from pyplugin.kv_types import KV_TYPES, decode, encode

    rng = np.random.default_rng(n_head)
    xp, n_rows, t = kernels.xp, 700, KV_TYPES[kv]
    n_pos = [700, 1, 129, 128, 300]
    q = rng.standard_normal((len(n_pos), n_head, head_dim)).astype(np.float32)
    caches = [tuple(encode((4 * rng.standard_normal((n_rows, n_kv, head_dim))).astype(np.float32), t)
                    for _ in range(2)) for _ in n_pos]
    scale = 1 / np.sqrt(head_dim)
    got = to_host(kernels.attend(xp.asarray(q), [(xp.asarray(k), xp.asarray(v)) for k, v in caches], n_pos, n_kv,
                                 scale, softcap))
    for b, ((k, v), n) in enumerate(zip(caches, n_pos)):
        np.testing.assert_allclose(got[b], reference(q[b], decode(k, t), decode(v, t), n, scale, softcap),
                                   rtol=2e-5, atol=2e-5)
        alone = to_host(kernels.attend(xp.asarray(q[b:b + 1]), [(xp.asarray(k), xp.asarray(v))], [n], n_kv, scale,
                                       softcap))
        np.testing.assert_array_equal(alone[0], got[b])

def test_malformed_calls_are_refused_naming_what_was_wrong(kernels):
    xp = kernels.xp
    q = xp.zeros((1, N_HEAD, HEAD_DIM), np.float32)
    cache = (xp.zeros((N_ROWS, N_KV, HEAD_DIM), np.float32), xp.zeros((N_ROWS, N_KV, HEAD_DIM), np.float32))
    with pytest.raises(SizeMismatchError, match=f"1..{N_ROWS}"):
        kernels.attend(q, [cache], [N_ROWS + 1], N_KV, 1.0)
    with pytest.raises(SizeMismatchError, match=f"1..{N_ROWS}"):
        kernels.attend(q, [cache], [0], N_KV, 1.0)
    three = tuple(xp.zeros((N_ROWS, 3, HEAD_DIM), np.float32) for _ in range(2))
    with pytest.raises(InvalidArgumentError, match="head"):
        kernels.attend(q, [three], [3], 3, 1.0)  # 8 query heads cannot share 3 KV heads
    with pytest.raises(InvalidArgumentError, match="int8"):
        kernels.attend(q, [tuple(c.astype(np.int8) for c in cache)], [3], N_KV, 1.0)
    scratch = xp.zeros(1 << 16, np.uint8)
    out = xp.zeros((1, N_HEAD * HEAD_DIM), np.float32)
    row = xp.zeros((1, N_KV * HEAD_DIM), np.float32)
    with pytest.raises(InvalidArgumentError, match="k_new and v_new go together"):
        kernels.lib.attend(q.reshape(1, -1), 0, [cache[0]], [cache[1]], [3], N_ROWS, N_HEAD, N_KV, HEAD_DIM, 1.0,
                           0.0, out, scratch, k_new=row)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_new_rows_are_stored_then_attended_in_the_same_call(kernels, dtype):
    """A decode step's new K/V rows given to the call land in row n_pos - 1 of each sequence's caches,
    rounded to the cache's type as numpy rounds them, and the result is what attending after writing
    them gives, bit for bit; nothing else in the caches changes."""
    rng = np.random.default_rng(2)
    xp = kernels.xp
    n_pos = [3, 1, N_ROWS]
    q = xp.asarray(rng.standard_normal((len(n_pos), N_HEAD, HEAD_DIM)).astype(np.float32))
    k_new, v_new = (rng.standard_normal((len(n_pos), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
    before = [tuple(rng.standard_normal((N_ROWS, N_KV, HEAD_DIM)).astype(dtype) for _ in range(2)) for _ in n_pos]
    written = [tuple(xp.asarray(c) for c in pair) for pair in before]
    expected = [tuple(c.copy() for c in pair) for pair in before]
    for b, n in enumerate(n_pos):
        expected[b][0][n - 1], expected[b][1][n - 1] = k_new[b], v_new[b]  # numpy's rounding
    got = to_host(kernels.attend(q, written, n_pos, N_KV, 0.2, 0.0, (xp.asarray(k_new), xp.asarray(v_new))))
    for (k, v), (k_want, v_want) in zip(written, expected):
        np.testing.assert_array_equal(to_host(k), k_want)
        np.testing.assert_array_equal(to_host(v), v_want)
    after = to_host(kernels.attend(q, [tuple(xp.asarray(c) for c in pair) for pair in expected], n_pos, N_KV, 0.2))
    np.testing.assert_array_equal(got, after)


def test_new_rows_of_the_wrong_size_are_refused(kernels):
    xp = kernels.xp
    q = xp.zeros((1, N_HEAD * HEAD_DIM), np.float32)
    cache = (xp.zeros((N_ROWS, N_KV, HEAD_DIM), np.float32), xp.zeros((N_ROWS, N_KV, HEAD_DIM), np.float32))
    short = xp.zeros((1, N_KV * HEAD_DIM - 1), np.float32)
    with pytest.raises(SizeMismatchError, match="k_new"):
        kernels.lib.attend(q, 0, [cache[0]], [cache[1]], [3], N_ROWS, N_HEAD, N_KV, HEAD_DIM, 1.0, 0.0,
                           xp.zeros((1, N_HEAD * HEAD_DIM), np.float32), xp.zeros(1 << 16, np.uint8),
                           k_new=short, v_new=short)
    assert not to_host(cache[0]).any()  # nothing written


@pytest.mark.parametrize("counts", [(2, 1, 2), (1, 2, 1), (2, 2, 1), (1, 1, 3), (0, 0, 0)],
                         ids=["fewer V caches", "fewer K caches", "fewer n_pos", "more n_pos", "no sequence"])
def test_unequal_numbers_of_caches_and_positions_are_refused_before_the_library_reads(kernels, counts):
    """pebble_attend reads n_seq entries of k_caches, v_caches and n_pos: a shorter list once made it read
    past its end (ASan: heap-buffer-overflow in pebble_attend). Now the call is refused naming the counts."""
    xp = kernels.xp
    n_k, n_v, n_n = counts
    n_seq = max(n_k, 1)
    pair = lambda: xp.zeros((N_ROWS, N_KV, HEAD_DIM), np.float32)  # noqa: E731
    q = xp.zeros((n_seq, N_HEAD * HEAD_DIM), np.float32)
    out = xp.zeros((n_seq, N_HEAD * HEAD_DIM), np.float32)
    with pytest.raises(SizeMismatchError, match=f"{n_k} K caches, {n_v} V caches and {n_n} n_pos"):
        kernels.lib.attend(q, 0, [pair() for _ in range(n_k)], [pair() for _ in range(n_v)], [3] * n_n, N_ROWS,
                           N_HEAD, N_KV, HEAD_DIM, 1.0, 0.0, out, xp.zeros(1 << 16, np.uint8))


def test_caches_attended_over_die_with_their_owner(kernels):
    """The kernels (one object per backend, shared by every model) keep nothing of the caches they attended
    over: dropped by their sequence, they are freed. A table of cache pointers once held every set attended
    (up to 256), so a model's KV caches outlived it (+256 MB a request at num_ctx 16384)."""
    import gc
    import weakref

    xp = kernels.xp
    q = xp.zeros((1, N_HEAD, HEAD_DIM), np.float32)
    cache = (xp.zeros((N_ROWS, N_KV, HEAD_DIM), np.float32), xp.zeros((N_ROWS, N_KV, HEAD_DIM), np.float32))
    for _ in range(2):  # the second call over the same caches takes any table's entry
        kernels.attend(q, [cache], [3], N_KV, 1.0)
    refs = [weakref.ref(c) for c in cache]
    del cache
    gc.collect()
    assert [r() for r in refs] == [None, None]
    # new arrays (which may take the freed ones' ids) are attended over as themselves, not through a stale entry
    k, v = (xp.asarray(np.random.default_rng(3).standard_normal((N_ROWS, N_KV, HEAD_DIM)).astype(np.float32))
            for _ in range(2))
    q1 = xp.asarray(np.random.default_rng(4).standard_normal((1, N_HEAD, HEAD_DIM)).astype(np.float32))
    got = to_host(kernels.attend(q1, [(k, v)], [5], N_KV, 0.5))[0]
    np.testing.assert_allclose(got, reference(to_host(q1)[0], to_host(k), to_host(v), 5, 0.5, 0.0), rtol=1e-5,
                               atol=1e-5)


def test_fewer_sequences_a_launch_give_the_same_attention():
    """PEBBLING_CUDA_GROUP=3 (a switch to compare on a GPU, or to go on where a group is in doubt): the
    portable host path, which runs the GPU's attention kernels in the same groups, over eleven sequences in
    four groups, each against the reference and the same alone, in a process of its own."""
    import os
    import subprocess
    import sys

    from pyplugin.store import probe
    if not probe("host").usable:
        pytest.skip("the host library is not built here (make host)")
    env = {**os.environ, "PEBBLING_SIMD": "portable", "PEBBLING_TEST_BACKENDS": "host", "PEBBLING_CUDA_GROUP": "3"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "host and more_sequences_than_one_launch"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_portable_attention_is_the_gpus_three_kernels_held_to_the_reference_too():
    """What a CPU without AVX2 runs (PEBBLING_SIMD=portable): the host tests above, and test_kv_types.py's
    attention over block caches, in a process of their own with the setting, where pebble_attend goes
    through the GPU's own attention kernels (scores, softmax, values) rather than the host's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from pyplugin.store import probe
    if not probe("host").usable:
        pytest.skip("the host library is not built here (make host)")
    env = {**os.environ, "PEBBLING_SIMD": "portable", "PEBBLING_TEST_BACKENDS": "host"}
    kv_types = Path(__file__).with_name("test_kv_types.py")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, str(kv_types),
                           "-k", "host and not portable and (attend or attention)"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]

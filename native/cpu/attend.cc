// cpu/attend.cc: the host library's attention of one query per (sequence, head) over each sequence's KV
// cache (F32, F16, Q8_0 or Q4_0: pebble_kv.h), soft-capped where asked (pebble_attend, and the decode
// step's attention): scores, softmax, the weighted sum of V, among the pool's threads. On AVX2 a unit is a
// chunk of one sequence's rows, its K rows read in order with every query head's score from each, V
// summed in registers, the chunks of a long sequence combined after (flash-decoding); portable C++ a
// (sequence, head) pair at a time.

#include "cpu/cpu.h"
#include "cpu/simd.h"
#include "pebble_internal.h"
#include "pebble_kv.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>

using pebble_internal::fail;
using pebble_internal::kv_block;
using pebble_internal::kv_blocked;
using pebble_internal::kv_block_bytes;
using pebble_internal::kv_f16;
using pebble_internal::kv_f32;
using pebble_internal::kv_load;
using pebble_internal::kv_q8_0;

namespace pebble_cpu {
namespace {

// ---------------------------------------------------------------------------------------------------
// attention of one query per (sequence, head)

struct attend_job {
    const float *        q;
    int32_t              type;      // the caches' KV type (pebble_kv.h)
    void * const *       k, * const * v;
    const int64_t *      n_pos;
    int64_t              n_rows;
    int32_t              n_head, n_head_kv, head_dim;
    float                scale, softcap;
    float *              out, * scratch;
    const float *        sinks;     // a logit per query head in its softmax, or NULL (gpt-oss)
};

inline float cache_value(const void * p, int32_t type, int64_t i) { return kv_load(p, type, i); }

// The n scores, whose largest is top, as their softmax: exp(s - top) over the sum of them all; with a sink
// (gpt-oss's head's logit; sinks NULL: none) the sink joins the largest and the sum, as GGML's soft_max.
inline void softmax_scores(float * sc, int64_t n, float top, const float * sinks, int64_t h) {
    if (sinks) top = std::max(top, sinks[h]);
    float total = 0.0f;
    for (int64_t s = 0; s < n; s++) {
        sc[s] = std::exp(sc[s] - top);
        total += sc[s];
    }
    if (sinks) total += std::exp(sinks[h] - top);
    for (int64_t s = 0; s < n; s++) sc[s] = sc[s] / total;
}

// The scores of row s: (q * scale) . k[s], soft-capped where asked; then softmax; then the weighted sum
// of V. Written once for both instruction sets: `dot` and `axpy` are the SIMD or portable loops.
template <typename Dot, typename Axpy>
inline void attend_head(const attend_job & j, int64_t unit, Dot dot, Axpy axpy) {
    const int64_t b = unit / j.n_head, h = unit % j.n_head;
    const int64_t group = j.n_head / j.n_head_kv, row = int64_t(j.n_head_kv) * j.head_dim;
    const int64_t kv = (h / group) * j.head_dim, n = j.n_pos[b];
    const float * qh = j.q + (b * j.n_head + h) * j.head_dim;
    float * sc = j.scratch + unit * j.n_rows;
    float top = -INFINITY;
    for (int64_t s = 0; s < n; s++) {
        float d = dot(qh, j.k[b], s * row + kv);
        if (j.softcap > 0.0f) d = std::tanh(d / j.softcap) * j.softcap;
        sc[s] = d;
        top = std::max(top, d);
    }
    softmax_scores(sc, n, top, j.sinks, h);
    float * o = j.out + (b * j.n_head + h) * j.head_dim;
    for (int32_t d = 0; d < j.head_dim; d++) o[d] = 0.0f;
    for (int64_t s = 0; s < n; s++) axpy(o, sc[s], j.v[b], s * row + kv);
}

void attend_portable(void * ctx, int64_t begin, int64_t end) {
    const attend_job & j = *static_cast<const attend_job *>(ctx);
    const int32_t hd = j.head_dim;
    for (int64_t u = begin; u < end; u++) {
        attend_head(j, u, [&](const float * qh, const void * k, int64_t at) {
            float acc = 0.0f;
            for (int32_t d = 0; d < hd; d++) acc += (qh[d] * j.scale) * cache_value(k, j.type, at + d);
            return acc;
        }, [&](float * o, float p, const void * v, int64_t at) {
            for (int32_t d = 0; d < hd; d++) o[d] += p * cache_value(v, j.type, at + d);
        });
    }
}

#ifdef PEBBLE_X86
// Values i..i+7 of a cache (i a multiple of 8, so a block type's eight lie in one block), as float32: the
// same products of scale and value as kv_load, so either way a score is the same.
AVX2 __attribute__((always_inline)) inline __m256 load8_cache(const void * p, int32_t type, int64_t i) {
    if (type == kv_f16) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(p) + i)));
    }
    if (type == kv_f32) return _mm256_loadu_ps(static_cast<const float *>(p) + i);
    const uint8_t * b = static_cast<const uint8_t *>(p) + (i / kv_block) * kv_block_bytes(type);
    const __m256 d = _mm256_set1_ps(f16c(b));
    const int64_t o = i % kv_block;
    if (type == kv_q8_0) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 2 + o));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 2 + (o & 15))));
    if (o >= 16) q = _mm256_srli_epi32(q, 4);
    q = _mm256_sub_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)), _mm256_set1_epi32(8));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
}

// The sums of four registers' lanes, each in hsum_ps's order (so a score is the same whichever way it
// was summed): out[i] = hsum_ps(a_i).
AVX2 inline void hsum4_ps(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float * out) {
    const __m256 x01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
    const __m256 x23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
    // lane 0 of each half: (0 + 2, 1 + 3) of a0 then a2; lane 1: of a1 then a3
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, z);
    out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[1], out[3] = lanes[5];
}

// attend_head's arithmetic, restructured: the scores four rows at a time (q scaled once per four), and the
// weighted sum of V 64 dims at a time held in registers over every row. Each score and each output is
// summed in the same order as attend_head sums it, so the results are the same bit for bit.
AVX2 void attend_avx2(void * ctx, int64_t begin, int64_t end) {
    const attend_job & j = *static_cast<const attend_job *>(ctx);
    const int32_t hd = j.head_dim, whole = hd / 8 * 8;
    const __m256 scale = _mm256_set1_ps(j.scale);
    const int64_t group = j.n_head / j.n_head_kv, row = int64_t(j.n_head_kv) * j.head_dim;
    for (int64_t u = begin; u < end; u++) {
        const int64_t b = u / j.n_head, h = u % j.n_head;
        const int64_t kv = (h / group) * j.head_dim, n = j.n_pos[b];
        const float * qh = j.q + (b * j.n_head + h) * j.head_dim;
        const void * k = j.k[b], * v = j.v[b];
        float * sc = j.scratch + u * j.n_rows;
        float top = -INFINITY;
        auto tail = [&](int64_t s, float sum) AVX2 {
            for (int32_t d = whole; d < hd; d++) sum += (qh[d] * j.scale) * cache_value(k, j.type, s * row + kv + d);
            if (j.softcap > 0.0f) sum = std::tanh(sum / j.softcap) * j.softcap;
            sc[s] = sum;
            top = std::max(top, sum);
        };
        int64_t s = 0;
        for (; s + 4 <= n; s += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int32_t d = 0; d < whole; d += 8) {
                const __m256 qv = _mm256_mul_ps(_mm256_loadu_ps(qh + d), scale);
                const int64_t at = s * row + kv + d;
                a0 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at), a0);
                a1 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at + row), a1);
                a2 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at + 2 * row), a2);
                a3 = _mm256_fmadd_ps(qv, load8_cache(k, j.type, at + 3 * row), a3);
            }
            float sums[4];
            hsum4_ps(a0, a1, a2, a3, sums);
            for (int i = 0; i < 4; i++) tail(s + i, sums[i]);
        }
        for (; s < n; s++) {
            __m256 acc = _mm256_setzero_ps();
            for (int32_t d = 0; d < whole; d += 8) {
                acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(qh + d), scale), load8_cache(k, j.type, s * row + kv + d),
                                      acc);
            }
            tail(s, hsum_ps(acc));
        }
        softmax_scores(sc, n, top, j.sinks, h);
        float * o = j.out + (b * j.n_head + h) * j.head_dim;
        int32_t d = 0;
        for (; d + 64 <= whole; d += 64) { // 8 registers over every row
            __m256 acc[8];
            UNROLL for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const __m256 pv = _mm256_set1_ps(sc[t]);
                UNROLL for (int r = 0; r < 8; r++) {
                    acc[r] = _mm256_fmadd_ps(pv, load8_cache(v, j.type, t * row + kv + d + 8 * r), acc[r]);
                }
            }
            UNROLL for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + d + 8 * r, acc[r]);
        }
        for (; d < whole; d += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[t]), load8_cache(v, j.type, t * row + kv + d), acc);
            _mm256_storeu_ps(o + d, acc);
        }
        for (; d < hd; d++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < n; t++) acc += sc[t] * cache_value(v, j.type, t * row + kv + d);
            o[d] = acc;
        }
    }
}

// The 32 values of a Q8_0 or Q4_0 block's quants (qs: the bytes after its scale), unscaled, as float32 in
// four registers of eight: the quants read once (16 bytes of Q4_0 hold all 32: low nibbles, then high).
AVX2 inline void block32(const uint8_t * qs, int32_t type, __m256 out[4]) {
    if (type == kv_q8_0) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs + 16));
        out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        return;
    }
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)), mask = _mm_set1_epi8(0x0F);
    const __m128i eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);                     // values 0..15
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight);  // values 16..31
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// Caches of every type (F32 and F16 with head_dim a multiple of 8; Q8_0 and Q4_0, whose head_dim is a
// multiple of 32), read in the order they lie in memory. A cache row holds
// every KV head of one position; reading one KV head down all the rows (256 of every 2048 bytes for
// Qwen3-0.6B's 8 heads of 128) left the hardware's prefetchers behind: on two threads of an AMD EPYC (Zen 4)
// over caches not in its caches, 0.44-0.67 ms a layer at 1000 rows, 0.23-0.30 ms read row after row (28
// layers of caches attended in turn, the two orders interleaved). Reading even two rows side by side
// (rows t and t + 1 for each KV head) lost half of that again. So a unit is a chunk of one sequence's rows
// (flash-decoding's split of the context) and its K rows are read in order, every query head's score from
// each, while the same rows of V are asked into L2 (software prefetch, in order); then each score s
// becomes exp(s - m), m the chunk's largest, l their total; then V, now in L2, is summed in registers over
// all the chunk's rows, 16 or 32 dims of up to 6 heads at a time (a 32-value block of up to 2 heads for
// Q8_0 and Q4_0): o = sum exp(s - m) v. A sequence of one
// chunk ends there (out = o / l); the chunks of a longer one are combined by attend_combine_avx2:
// out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M the largest m_c. How a sequence's rows are
// chunked depends on its own row count alone, so its result is the same beside any others.
constexpr int64_t attend_chunk_rows = 128, attend_most_chunks = 64;

inline int64_t attend_chunks(int64_t n) { return std::min(attend_most_chunks, (n + attend_chunk_rows - 1) / attend_chunk_rows); }

struct rows_job {
    const attend_job * j;
    const int64_t *    first;  // first[b]: sequence b's first unit; first[n_seq]: every unit
    const float *      qs;     // [n_seq][n_head][head_dim]: q times scale
    float *            part;   // per unit: o [n_head][head_dim], then m [n_head], then l [n_head]
};

inline int64_t part_floats(const attend_job & j) { return int64_t(j.n_head) * (j.head_dim + 2); }

// Up to 8 query heads of one KV head: their scores against one cache row (out[i * stride]). Each head sums
// in A registers (8 for one head, 4 for two, 2 for up to six, else 1), so that several chains of
// multiply-adds run side by side: with one a head, Qwen3's pairs of heads waited on each add's latency.
template <int G>
AVX2 inline void row_scores(const float * q, int32_t hd, const void * k, int32_t type, int64_t at, float * out,
                            int64_t stride) {
    constexpr int A = G == 1 ? 8 : G == 2 ? 4 : G <= 6 ? 2 : 1;
    __m256 acc[G][A];
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int a = 0; a < A; a++) acc[i][a] = _mm256_setzero_ps();
    int32_t d = 0;
    for (; d + 8 * A <= hd; d += 8 * A) {
        UNROLL for (int a = 0; a < A; a++) {
            const __m256 x = load8_cache(k, type, at + d + 8 * a);
            UNROLL for (int i = 0; i < G; i++) {
                acc[i][a] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * hd + d + 8 * a), x, acc[i][a]);
            }
        }
    }
    for (; d < hd; d += 8) {
        const __m256 x = load8_cache(k, type, at + d);
        UNROLL for (int i = 0; i < G; i++) acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * hd + d), x, acc[i][0]);
    }
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int a = 1; a < A; a++) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][a]);
    int i = 0;
    for (; i + 4 <= G; i += 4) { // four heads' lanes summed together, each as hsum_ps sums
        float sums[4];
        hsum4_ps(acc[i][0], acc[i + 1][0], acc[i + 2][0], acc[i + 3][0], sums);
        UNROLL for (int c = 0; c < 4; c++) out[(i + c) * stride] = sums[c];
    }
    for (; i < G; i++) out[i * stride] = hsum_ps(acc[i][0]);
}

// 8 * NB dims of up to 6 query heads of one KV head, summed over the rows s0..s1 of V (in L2 by now):
// o[i * hd + d] = sum_t p[i * stride + t] v_t[d], for the NB blocks of 8 dims from `at`.
template <int G, int NB>
AVX2 inline void column_values(const float * p, int64_t stride, const void * v, int32_t type, int64_t at, int64_t row,
                               int64_t s0, int64_t s1, float * o, int32_t hd) {
    __m256 acc[G][NB];
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < NB; c++) acc[i][c] = _mm256_setzero_ps();
    for (int64_t t = s0; t < s1; t++) {
        __m256 x[NB];
        UNROLL for (int c = 0; c < NB; c++) x[c] = load8_cache(v, type, at + t * row + 8 * c);
        UNROLL for (int i = 0; i < G; i++) {
            const __m256 w = _mm256_broadcast_ss(p + i * stride + t);
            UNROLL for (int c = 0; c < NB; c++) acc[i][c] = _mm256_fmadd_ps(w, x[c], acc[i][c]);
        }
    }
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < NB; c++) _mm256_storeu_ps(o + i * hd + 8 * c, acc[i][c]);
}

// row_scores over Q8_0 or Q4_0 blocks (k: the KV head's first block in the row): a block's quants converted
// in registers once for the G heads and its scale applied once to each head's part of the score.
template <int G>
AVX2 inline void row_scores_blocks(const float * q, int32_t hd, const uint8_t * k, int32_t type, float * out,
                                   int64_t stride) {
    const int64_t bb = kv_block_bytes(type);
    __m256 acc[G];
    UNROLL for (int i = 0; i < G; i++) acc[i] = _mm256_setzero_ps();
    for (int32_t c = 0; c < hd; c += kv_block, k += bb) {
        __m256 x[4];
        block32(k + 2, type, x);
        const __m256 d = _mm256_set1_ps(f16c(k));
        UNROLL for (int i = 0; i < G; i++) {
            const float * qi = q + i * hd + c;
            __m256 part = _mm256_mul_ps(_mm256_loadu_ps(qi), x[0]);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8), x[1], part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 16), x[2], part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 24), x[3], part);
            acc[i] = _mm256_fmadd_ps(d, part, acc[i]);
        }
    }
    UNROLL for (int i = 0; i < G; i++) out[i * stride] = hsum_ps(acc[i]);
}

// column_values over one block (32 dims) of Q8_0 or Q4_0 for G <= 2 heads (v: the block in row 0), the
// block's scale folded into each row's weight.
template <int G>
AVX2 inline void column_values_blocks(const float * p, int64_t stride, const uint8_t * v, int32_t type,
                                      int64_t row_bytes, int64_t s0, int64_t s1, float * o, int32_t hd) {
    __m256 acc[G][4];
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();
    for (int64_t t = s0; t < s1; t++) {
        const uint8_t * blk = v + t * row_bytes;
        __m256 x[4];
        block32(blk + 2, type, x);
        const float d = f16c(blk);
        UNROLL for (int i = 0; i < G; i++) {
            const __m256 w = _mm256_set1_ps(p[i * stride + t] * d);
            UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm256_fmadd_ps(w, x[c], acc[i][c]);
        }
    }
    UNROLL for (int i = 0; i < G; i++) UNROLL for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + i * hd + 8 * c, acc[i][c]);
}

// f(std::integral_constant<int, g>) for g in 1..8.
template <typename F>
AVX2 inline void with_heads(int g, F && f) {
    switch (g) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// The query heads of one KV head in runs of at most `most`, as even as they come (8 in 6s: 4 and 4): how
// many a run takes (worked out once per call: two divisions a row and KV head cost a fifth of the scores).
inline int64_t run_heads(int64_t group, int64_t most) {
    const int64_t runs = (group + most - 1) / most;
    return (group + runs - 1) / runs;
}

// f(first head, heads) for the runs of `per` (run_heads) of query heads h0 .. h0 + group - 1.
template <typename F>
inline void head_runs(int64_t h0, int64_t group, int64_t per, F && f) {
    for (int64_t h = 0; h < group; h += per) f(h0 + h, std::min(per, group - h));
}

// The chunk's scores into exp(s - m), m their largest (returned), and their total into *l.
AVX2 inline float chunk_softmax(float * p, int64_t s0, int64_t s1, float softcap, float * l) {
    if (softcap > 0.0f) {
        for (int64_t s = s0; s < s1; s++) p[s] = std::tanh(p[s] / softcap) * softcap;
    }
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t s = s0;
    for (; s + 8 <= s1; s += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(p + s));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    float top = -INFINITY;
    for (float x : lanes) top = std::max(top, x);
    for (; s < s1; s++) top = std::max(top, p[s]);
    const __m256 t = _mm256_set1_ps(top);
    __m256 total8 = _mm256_setzero_ps();
    for (s = s0; s + 8 <= s1; s += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + s), t));
        _mm256_storeu_ps(p + s, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = hsum_ps(total8);
    for (; s < s1; s++) {
        p[s] = exp_nonpositive(p[s] - top);
        total += p[s];
    }
    *l = total;
    return top;
}

AVX2 void attend_rows_avx2(void * ctx, int64_t begin, int64_t end) {
    const rows_job & r = *static_cast<const rows_job *>(ctx);
    const attend_job & j = *r.j;
    const int32_t hd = j.head_dim;
    const int64_t group = j.n_head / j.n_head_kv, row = int64_t(j.n_head_kv) * hd;
    const int64_t row_bytes = pebble_internal::kv_bytes(j.type, row);
    const int64_t score_run = run_heads(group, 8), value_run = run_heads(group, 6), block_run = run_heads(group, 2);
    const bool blocked = kv_blocked(j.type);
    const int64_t head_bytes = pebble_internal::kv_bytes(j.type, hd); // a KV head's part of a row
    int64_t b = 0;
    for (int64_t u = begin; u < end; u++) {
        while (r.first[b + 1] <= u) b++;
        const int64_t n = j.n_pos[b], chunks = r.first[b + 1] - r.first[b], c = u - r.first[b];
        const int64_t s0 = n * c / chunks, s1 = n * (c + 1) / chunks;
        const float * q = r.qs + b * j.n_head * hd;
        float * sc = j.scratch + b * j.n_head * j.n_rows;
        // one chunk: straight into the output, divided by l below; else the unit's partial sums
        float * o = chunks == 1 ? j.out + b * j.n_head * hd : r.part + u * part_floats(j);
        float * m = r.part + u * part_floats(j) + int64_t(j.n_head) * hd, * l = m + j.n_head;
        const void * k = j.k[b], * v = j.v[b];
        for (int64_t s = s0; s < s1; s++) {
            const char * vr = static_cast<const char *>(v) + s * row_bytes;
            for (int64_t i = 0; i < row_bytes; i += 64) _mm_prefetch(vr + i, _MM_HINT_T1);
            for (int64_t g = 0; g < j.n_head_kv; g++) {
                head_runs(g * group, group, score_run, [&](int64_t h, int64_t heads) AVX2 {
                    with_heads(int(heads), [&](auto G) AVX2 {
                        constexpr int H = decltype(G)::value;
                        if (blocked) {
                            row_scores_blocks<H>(q + h * hd, hd, static_cast<const uint8_t *>(k) + s * row_bytes +
                                                 g * head_bytes, j.type, sc + h * j.n_rows + s, j.n_rows);
                        } else {
                            row_scores<H>(q + h * hd, hd, k, j.type, s * row + g * hd, sc + h * j.n_rows + s, j.n_rows);
                        }
                    });
                });
            }
        }
        for (int64_t h = 0; h < j.n_head; h++) m[h] = chunk_softmax(sc + h * j.n_rows, s0, s1, j.softcap, l + h);
        for (int64_t g = 0; blocked && g < j.n_head_kv; g++) {
            head_runs(g * group, group, block_run, [&](int64_t h, int64_t heads) AVX2 {
                for (int32_t c = 0; c < hd; c += kv_block) {
                    const uint8_t * vb = static_cast<const uint8_t *>(v) + g * head_bytes + c / kv_block * kv_block_bytes(j.type);
                    if (heads == 2) {
                        column_values_blocks<2>(sc + h * j.n_rows, j.n_rows, vb, j.type, row_bytes, s0, s1, o + h * hd + c, hd);
                    } else {
                        column_values_blocks<1>(sc + h * j.n_rows, j.n_rows, vb, j.type, row_bytes, s0, s1, o + h * hd + c, hd);
                    }
                }
            });
        }
        for (int64_t g = 0; !blocked && g < j.n_head_kv; g++) {
            head_runs(g * group, group, value_run, [&](int64_t h, int64_t heads) AVX2 {
                with_heads(int(heads), [&](auto G) AVX2 {
                    constexpr int H = decltype(G)::value;
                    if constexpr (H <= 6) {
                        constexpr int NB = H <= 2 ? 4 : 2;
                        int32_t d = 0;
                        for (; d + 8 * NB <= hd; d += 8 * NB) {
                            column_values<H, NB>(sc + h * j.n_rows, j.n_rows, v, j.type, g * hd + d, row, s0, s1,
                                                 o + h * hd + d, hd);
                        }
                        for (; d < hd; d += 8) {
                            column_values<H, 1>(sc + h * j.n_rows, j.n_rows, v, j.type, g * hd + d, row, s0, s1,
                                                o + h * hd + d, hd);
                        }
                    }
                });
            });
        }
        if (chunks == 1) {
            for (int64_t h = 0; h < j.n_head; h++) {
                // a sink: one more term of the softmax, o weighted by exp(m - M), M the larger of m and the sink
                const float top = j.sinks ? std::max(m[h], j.sinks[h]) : m[h], w = j.sinks ? std::exp(m[h] - top) : 1.0f;
                const __m256 inv = _mm256_set1_ps(j.sinks ? w / (w * l[h] + std::exp(j.sinks[h] - top)) : 1.0f / l[h]);
                for (int32_t d = 0; d < hd; d += 8) {
                    _mm256_storeu_ps(o + h * hd + d, _mm256_mul_ps(_mm256_loadu_ps(o + h * hd + d), inv));
                }
            }
        }
    }
}

// The chunks of sequence u / n_head, head u % n_head, combined into its output (sequences of one chunk
// are done already).
AVX2 void attend_combine_avx2(void * ctx, int64_t begin, int64_t end) {
    const rows_job & r = *static_cast<const rows_job *>(ctx);
    const attend_job & j = *r.j;
    const int32_t hd = j.head_dim;
    const int64_t per = part_floats(j), ml = int64_t(j.n_head) * hd; // a unit's floats; where its m begin
    for (int64_t u = begin; u < end; u++) {
        const int64_t b = u / j.n_head, h = u % j.n_head, first = r.first[b], chunks = r.first[b + 1] - first;
        if (chunks == 1) continue;
        const float * part = r.part + first * per;
        float top = -INFINITY, total = 0.0f, w[attend_most_chunks];
        for (int64_t c = 0; c < chunks; c++) top = std::max(top, part[c * per + ml + h]);
        if (j.sinks) top = std::max(top, j.sinks[h]);
        for (int64_t c = 0; c < chunks; c++) {
            w[c] = exp_nonpositive(part[c * per + ml + h] - top);
            total += w[c] * part[c * per + ml + j.n_head + h];
        }
        if (j.sinks) total += exp_nonpositive(j.sinks[h] - top);
        for (int64_t c = 0; c < chunks; c++) w[c] /= total;
        float * out = j.out + u * hd;
        for (int32_t d = 0; d < hd; d += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(part + c * per + h * hd + d), acc);
            }
            _mm256_storeu_ps(out + d, acc);
        }
    }
}
#endif

} // namespace

pebble_status attend(int32_t n_seq, const float * q, int32_t kv_type, void * const * k_caches, void * const * v_caches,
                     const int64_t * n_pos, int64_t n_rows, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                     float scale, float softcap, float * out, float * scratch, const float * sinks) {
    TRY(check_threads("pebble_attend"));
    attend_job job{q, kv_type, k_caches, v_caches, n_pos, n_rows, n_head, n_head_kv, head_dim, scale, softcap, out, scratch,
                   sinks};
    // What the pool judges the call by: its multiply-adds, eight times over, as a decode step's caches come
    // from memory, not from cache (their rows were last read a whole step of weights ago): SmolLM2's 8
    // sequences of 48 rows, serial by their multiply-adds alone, took 30% less time on two threads.
    int64_t work = 0;
    for (int32_t b = 0; b < n_seq; b++) work += 2 * n_pos[b] * n_head * head_dim;
    work *= 8;
#ifdef PEBBLE_X86
    if (simd_in_use() != simd::portable) {
        if (head_dim % 8 == 0) { // the block types' head_dim is a multiple of 32 (pebble_attend's check)
            // The scaled queries and each chunk's partial sums: the calling thread's, kept for its next call.
            thread_local std::vector<int64_t> first;
            thread_local std::vector<float> floats;
            int64_t units = 0;
            try {
                first.resize(size_t(n_seq) + 1);
                for (int32_t b = 0; b < n_seq; b++) first[b] = units, units += attend_chunks(n_pos[b]);
                first[n_seq] = units;
                floats.resize(size_t(int64_t(n_seq) * n_head * head_dim + units * part_floats(job)));
            } catch (const std::bad_alloc &) {
                return fail(PEBBLE_ERR_HOST_OOM, "pebble_attend: no host memory for the partial sums of %" PRId64
                            " chunks of %" PRId64 " rows", units, attend_chunk_rows);
            }
            float * qs = floats.data();
            for (int64_t i = 0; i < int64_t(n_seq) * n_head * head_dim; i++) qs[i] = q[i] * scale;
            rows_job rows{&job, first.data(), qs, qs + int64_t(n_seq) * n_head * head_dim};
            parallel_ranges(units, work, attend_rows_avx2, &rows);
            if (units > n_seq) {
                parallel_ranges(int64_t(n_seq) * n_head, units * n_head * head_dim, attend_combine_avx2, &rows);
            }
            return PEBBLE_OK;
        }
        parallel_ranges(int64_t(n_seq) * n_head, work, attend_avx2, &job);
        return PEBBLE_OK;
    }
#endif
    parallel_ranges(int64_t(n_seq) * n_head, work, attend_portable, &job);
    return PEBBLE_OK;
}

} // namespace pebble_cpu

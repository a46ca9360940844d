// cpu/attend_prompt.cc: a prompt's causal attention on the host (pebble_cpu::attend_prompt, for
// pebble_attend_prompt), over a cache of F32, F16, Q8_0 or Q4_0 (pebble_kv.h), with a sliding window and
// soft-cap where asked.
//
// A prefill chunk of T queries attends over every earlier position and its own: T x S scores per head,
// most of a long prompt's arithmetic outside the weights. It is computed as flash attention computes it,
// so that no T x S matrix is written: a unit of work is one KV head and a tile of queries, with every
// query head that reads that KV head (so each key is decoded once for all of them). A unit walks the keys
// its queries see in blocks of 32, decodes each block from the cache's type into float32 once (K
// transposed, so 32 scores of a row are four FMA chains), and keeps for each row its running maximum,
// sum and weighted sum of V, rescaled as the maximum grows. Blocks wholly in the future (or wholly out
// of a sliding layer's window) are never visited, so a causal prompt costs half the products of a full
// one. The largest tiles are handed out first, so that the threads finish together.

#include "cpu/cpu.h"
#include "cpu/simd.h"

#include "pebble_internal.h"
#include "pebble_kv.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>


using pebble_internal::kv_f16;
using pebble_internal::kv_f32;
using pebble_internal::kv_load;

namespace pebble_cpu {
namespace {

constexpr int block_keys = 32;  // keys decoded and scored together
constexpr int tile_rows = 64;   // about this many (query, head) rows share each decoded block

struct prompt_job {
    const float *   q;          // [n_tok][n_head][head_dim], rotated, not scaled
    int64_t         n_tok, pos; // the queries' positions: pos .. pos + n_tok - 1
    int32_t         type;
    const void *    k, * v;     // [rows][n_head_kv][head_dim] of type
    int32_t         n_head, n_head_kv, head_dim;
    int64_t         window;     // 0: none; else a query at p sees keys p - window + 1 .. p
    float           scale, softcap;
    float *         out;        // [n_tok][n_head][head_dim]
    const float *   sinks;      // [n_head] or NULL: a logit per head in its softmax, weighting no value
    int64_t         tile, n_tiles, group;
    bool            simd;
    std::atomic<bool> failed;   // a worker could not allocate its buffers
};

// A unit's buffers: its rows' scaled queries, the decoded block (K transposed, V as rows), the block's
// scores, and each row's running maximum, sum and output.
struct unit_buffers {
    float * q, * kt, * vb, * s, * m, * l, * o, * krow;
    float * base = nullptr;

    bool make(const prompt_job & j) {
        const int64_t rows = j.tile * j.group, hd = j.head_dim;
        const int64_t floats = rows * hd + hd * block_keys + block_keys * hd + rows * block_keys + 2 * rows + rows * hd + hd;
        base = static_cast<float *>(std::aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64));
        if (!base) return false;
        q = base;
        kt = q + rows * hd;
        vb = kt + hd * block_keys;
        s = vb + block_keys * hd;
        m = s + rows * block_keys;
        l = m + rows;
        o = l + rows;
        krow = o + rows * hd;
        return true;
    }
    ~unit_buffers() { std::free(base); }
};

#ifdef PEBBLE_X86
#    define PROMPT_AVX2 __attribute__((target("avx2,fma,f16c")))
#    define PROMPT_UNROLL _Pragma("GCC unroll 8")

// n fp16 values (n a multiple of 8) as float32.
PROMPT_AVX2 void halves_avx2(const uint16_t * h, int32_t n, float * dst) {
    for (int32_t d = 0; d < n; d += 8) {
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h + d))));
    }
}
#endif

// Cache row r's KV head g (head_dim values of the cache's type) as float32.
inline void load_head(const prompt_job & j, const void * cache, int64_t r, int64_t g, float * dst) {
    const int64_t at = (r * j.n_head_kv + g) * j.head_dim;
    if (j.type == kv_f32) {
        std::memcpy(dst, static_cast<const float *>(cache) + at, sizeof(float) * j.head_dim);
        return;
    }
#ifdef PEBBLE_X86
    if (j.type == kv_f16 && j.simd) {
        halves_avx2(static_cast<const uint16_t *>(cache) + at, j.head_dim, dst);
        return;
    }
#endif
    for (int32_t d = 0; d < j.head_dim; d++) dst[d] = kv_load(cache, j.type, at + d);
}

// s[r][c] = q[r] . kt[.][c] for rows [0, rows) and the block's 32 columns.
void scores_portable(const float * q, const float * kt, int64_t rows, int32_t hd, float * s) {
    for (int64_t r = 0; r < rows; r++) {
        float acc[block_keys] = {};
        for (int32_t d = 0; d < hd; d++) {
            const float qd = q[r * hd + d];
            for (int c = 0; c < block_keys; c++) acc[c] += qd * kt[d * block_keys + c];
        }
        std::memcpy(s + r * block_keys, acc, sizeof(acc));
    }
}

// o[r] += sum over c < n of p[r][c] * vb[c] for rows [0, rows).
void weighted_portable(const float * p, const float * vb, int64_t rows, int n, int32_t hd, float * o) {
    for (int64_t r = 0; r < rows; r++) {
        for (int c = 0; c < n; c++) {
            const float w = p[r * block_keys + c];
            if (w == 0.0f) continue;
            for (int32_t d = 0; d < hd; d++) o[r * hd + d] += w * vb[c * hd + d];
        }
    }
}

#ifdef PEBBLE_X86
// Two rows at a time: 8 accumulators (two rows x 32 columns), one load of kt per 4 FMAs per row.
PROMPT_AVX2 void scores_avx2(const float * q, const float * kt, int64_t rows, int32_t hd, float * s) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
        __m256 acc[2][4];
        PROMPT_UNROLL for (int i = 0; i < 2; i++) PROMPT_UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();
        for (int32_t d = 0; d < hd; d++) {
            __m256 k[4];
            PROMPT_UNROLL for (int c = 0; c < 4; c++) k[c] = _mm256_load_ps(kt + d * block_keys + 8 * c);
            PROMPT_UNROLL for (int i = 0; i < 2; i++) {
                const __m256 x = _mm256_broadcast_ss(q + (r + i) * hd + d);
                PROMPT_UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm256_fmadd_ps(x, k[c], acc[i][c]);
            }
        }
        PROMPT_UNROLL for (int i = 0; i < 2; i++) {
            PROMPT_UNROLL for (int c = 0; c < 4; c++) _mm256_store_ps(s + (r + i) * block_keys + 8 * c, acc[i][c]);
        }
    }
    if (r < rows) scores_portable(q + r * hd, kt, rows - r, hd, s + r * block_keys);
}

// Four rows by 16 columns of o at a time: 8 accumulators, two loads of V per 8 FMAs. hd % 16 == 0.
PROMPT_AVX2 void weighted_avx2(const float * p, const float * vb, int64_t rows, int n, int32_t hd, float * o) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        for (int32_t d = 0; d < hd; d += 16) {
            __m256 acc[4][2];
            PROMPT_UNROLL for (int i = 0; i < 4; i++) {
                PROMPT_UNROLL for (int h = 0; h < 2; h++) acc[i][h] = _mm256_loadu_ps(o + (r + i) * hd + d + 8 * h);
            }
            for (int c = 0; c < n; c++) {
                const __m256 v0 = _mm256_loadu_ps(vb + c * hd + d), v1 = _mm256_loadu_ps(vb + c * hd + d + 8);
                PROMPT_UNROLL for (int i = 0; i < 4; i++) {
                    const __m256 w = _mm256_broadcast_ss(p + (r + i) * block_keys + c);
                    acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
                }
            }
            PROMPT_UNROLL for (int i = 0; i < 4; i++) {
                PROMPT_UNROLL for (int h = 0; h < 2; h++) _mm256_storeu_ps(o + (r + i) * hd + d + 8 * h, acc[i][h]);
            }
        }
    }
    if (r < rows) weighted_portable(p + r * block_keys, vb, rows - r, n, hd, o + r * hd);
}

// Row s's 32 scores as exp(s - top), in place; returns their sum.
PROMPT_AVX2 float exp_row_avx2(float * s, float top) {
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < block_keys; c += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_load_ps(s + c), t));
        _mm256_store_ps(s + c, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum_ps(sum);
}
#endif

float exp_row_portable(float * s, float top) {
    float sum = 0.0f;
    for (int c = 0; c < block_keys; c++) {
        s[c] = exp_nonpositive(s[c] - top);
        sum += s[c];
    }
    return sum;
}

#ifdef PEBBLE_X86
// The largest of 32 scores and top.
PROMPT_AVX2 inline float block_max_avx2(const float * s, float top) {
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_load_ps(s), _mm256_load_ps(s + 8)),
                             _mm256_max_ps(_mm256_load_ps(s + 16), _mm256_load_ps(s + 24)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return std::max(top, _mm_cvtss_f32(h));
}
#endif

// Unit u: KV head g over query tile t (the tiles of most keys first). Written once for both instruction
// sets; Simd picks the AVX2 loops (the caller is compiled for AVX2 where it is true).
template <bool Simd>
__attribute__((always_inline)) inline void unit_body(const prompt_job & j, unit_buffers & b, int64_t u) {
    const int64_t g = u % j.n_head_kv, t = j.n_tiles - 1 - u / j.n_head_kv;
    const int64_t t0 = t * j.tile, t1 = std::min(j.n_tok, t0 + j.tile), G = j.group, hd = j.head_dim;
    const int64_t rows = (t1 - t0) * G;
    // Row (i, h) is query t0 + i of head g * G + h, scaled as the scores want it.
    for (int64_t i = 0; i < t1 - t0; i++) {
        for (int64_t h = 0; h < G; h++) {
            const float * src = j.q + ((t0 + i) * j.n_head + g * G + h) * hd;
            float * dst = b.q + (i * G + h) * hd;
            for (int64_t d = 0; d < hd; d++) dst[d] = src[d] * j.scale;
        }
    }
    std::fill(b.m, b.m + rows, -INFINITY);
    std::fill(b.l, b.l + rows, 0.0f);
    std::fill(b.o, b.o + rows * hd, 0.0f);
    const int64_t first_p = j.pos + t0, last_p = j.pos + t1 - 1;
    const int64_t lo = j.window ? std::max<int64_t>(0, first_p - j.window + 1) : 0, hi = last_p + 1;
    for (int64_t k0 = lo; k0 < hi; k0 += block_keys) {
        const int n = static_cast<int>(std::min<int64_t>(block_keys, hi - k0));
        for (int c = 0; c < n; c++) {
            load_head(j, j.k, k0 + c, g, b.krow);
            for (int64_t d = 0; d < hd; d++) b.kt[d * block_keys + c] = b.krow[d];
            load_head(j, j.v, k0 + c, g, b.vb + c * hd);
        }
        for (int c = n; c < block_keys; c++) {
            for (int64_t d = 0; d < hd; d++) b.kt[d * block_keys + c] = 0.0f;
        }
        if constexpr (Simd) scores_avx2(b.q, b.kt, rows, j.head_dim, b.s);
        else scores_portable(b.q, b.kt, rows, j.head_dim, b.s);
        // Every row sees every key of the block unless it is a partial block, reaches past the tile's first
        // query, or starts out of the last query's window: only those blocks are masked key by key.
        const bool whole = n == block_keys && k0 + block_keys - 1 <= first_p && !(j.window && last_p - k0 >= j.window);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t p = j.pos + t0 + r / G;
            float * s = b.s + r * block_keys;
            float top = b.m[r];
            if (j.softcap > 0.0f) {
                for (int c = 0; c < block_keys; c++) s[c] = std::tanh(s[c] / j.softcap) * j.softcap;
            }
            if (whole) {
#ifdef PEBBLE_X86
                if constexpr (Simd) top = block_max_avx2(s, top);
                else
#endif
                    for (int c = 0; c < block_keys; c++) top = std::max(top, s[c]);
            } else {
                for (int c = 0; c < block_keys; c++) {
                    const int64_t key = k0 + c;
                    if (c >= n || key > p || (j.window && p - key >= j.window)) s[c] = -INFINITY;
                    else top = std::max(top, s[c]);
                }
            }
            if (top == -INFINITY) { // nothing of this block is seen by this row
                std::fill(s, s + block_keys, 0.0f);
                continue;
            }
            const float rescale = b.m[r] == -INFINITY ? 0.0f : exp_nonpositive(b.m[r] - top);
#ifdef PEBBLE_X86
            float sum;
            if constexpr (Simd) sum = exp_row_avx2(s, top);
            else sum = exp_row_portable(s, top);
#else
            const float sum = exp_row_portable(s, top);
#endif
            b.l[r] = b.l[r] * rescale + sum;
            b.m[r] = top;
            if (rescale != 1.0f) {
                float * o = b.o + r * hd;
                for (int64_t d = 0; d < hd; d++) o[d] *= rescale;
            }
        }
        if constexpr (Simd) weighted_avx2(b.s, b.vb, rows, n, j.head_dim, b.o);
        else weighted_portable(b.s, b.vb, rows, n, j.head_dim, b.o);
    }
    for (int64_t i = 0; i < t1 - t0; i++) {
        for (int64_t h = 0; h < G; h++) {
            const int64_t r = i * G + h;
            float inv = 1.0f / b.l[r];
            if (j.sinks) { // one more term of the softmax: o and l weighted by exp(m - M), M the larger of m and it
                const float sink = j.sinks[g * G + h], top = std::max(b.m[r], sink), w = std::exp(b.m[r] - top);
                inv = w / (w * b.l[r] + std::exp(sink - top));
            }
            float * dst = j.out + ((t0 + i) * j.n_head + g * G + h) * hd;
            for (int64_t d = 0; d < hd; d++) dst[d] = b.o[r * hd + d] * inv;
        }
    }
}

#ifdef PEBBLE_X86
PROMPT_AVX2 void units_avx2(const prompt_job & j, unit_buffers & b, int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; u++) unit_body<true>(j, b, u);
}
#endif

void units_portable(const prompt_job & j, unit_buffers & b, int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; u++) unit_body<false>(j, b, u);
}

void prompt_units(void * ctx, int64_t begin, int64_t end) {
    prompt_job & j = *static_cast<prompt_job *>(ctx);
    unit_buffers b{};
    if (!b.make(j)) {
        j.failed = true;
        return;
    }
#ifdef PEBBLE_X86
    if (j.simd) {
        units_avx2(j, b, begin, end);
        return;
    }
#endif
    units_portable(j, b, begin, end);
}

} // namespace

pebble_status attend_prompt(const float * q, int64_t n_tok, int64_t pos, int32_t kv_type, const void * k_cache,
                            const void * v_cache, int32_t n_head, int32_t n_head_kv, int32_t head_dim, int64_t window,
                            float scale, float softcap, float * out, const float * sinks) {
    TRY(check_threads("pebble_attend_prompt"));
    const int64_t group = n_head / n_head_kv;
    const int64_t tile = std::max<int64_t>(1, tile_rows / group);
    const char * level = simd_level();
    prompt_job job{q, n_tok, pos, kv_type, k_cache, v_cache, n_head, n_head_kv, head_dim, window, scale, softcap, out,
                   sinks, tile, (n_tok + tile - 1) / tile, group, std::strcmp(level, "portable") != 0 && head_dim % 16 == 0,
                   {false}};
    // About one unit per multiply-add: the scores and the weighted sum, over the keys each query sees.
    const int64_t keys = window ? std::min<int64_t>(window, pos + n_tok) : pos + n_tok / 2 + 1;
    parallel_ranges(job.n_tiles * n_head_kv, 2 * n_tok * keys * n_head * int64_t(head_dim), prompt_units, &job);
    if (job.failed) {
        return pebble_internal::fail(PEBBLE_ERR_HOST_OOM, "pebble_attend_prompt: could not allocate a worker's "
                                     "buffers for %" PRId64 " rows of %d", tile * group, head_dim);
    }
    return PEBBLE_OK;
}

} // namespace pebble_cpu

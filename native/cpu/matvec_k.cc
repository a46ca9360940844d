// cpu/matvec_k.cc: the CPU's row kernels for the K-quants, Q4_K, Q5_K and Q6_K (256-element super-blocks of
// 6-bit scales, and mins for Q4_K and Q5_K): one weight row times up to 4 (8 on AVX-512) activations
// quantized to 8-bit blocks of 256 with each 16's sum, each sub-block's integer dot product exact, times
// its scale, the mins through x's sums: portable C++, AVX2 (vpmaddubsw / vpmaddwd) and AVX-512 VNNI
// (vpdpbusd / vpdpwssd), and on AVX-512 sixteen rows at a time (Q4_K, Q6_K) with the same bits for each row
// as its row kernel gives it. cpu/matmul.cc runs them over a matrix's rows.

#include "cpu/quants.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pebble_cpu {
namespace {

// Q4_K / Q5_K: q in 0..15 (0..31), value d * scale_j * q - dmin * min_j per 32-element sub-block j.
template <int K, int NV>
void dot_k45_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = K == k_q4_k ? 144 : 176;
    float acc[NV] = {};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        const float d = f16(b), dmin = f16(b + 2);
        int sc[8], mn[8];
        for (int j = 0; j < 8; j++) scale_min_k4(b + 4, j, sc[j], mn[j]);
        int8_t q[256];
        const uint8_t * qs = b + (K == k_q4_k ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            for (int l = 0; l < 32; l++) {
                int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf;
                if (K == k_q5_k) v |= ((b[16 + l] >> j) & 1) << 4;
                q[32 * j + l] = static_cast<int8_t>(v);
            }
        }
        for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            int sumi = 0, summ = 0;
            for (int j = 0; j < 8; j++) {
                int s = 0;
                for (int l = 0; l < 32; l++) s += q[32 * j + l] * a.qs[32 * j + l];
                sumi += sc[j] * s;
                summ += mn[j] * (a.sums[2 * j] + a.sums[2 * j + 1]);
            }
            acc[v] += a.d * d * static_cast<float>(sumi) - a.d * dmin * static_cast<float>(summ);
        }
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// Q6_K: q in -32..31, value d * scale_g * q per 16-element group g.
template <int NV>
void dot_q6_k_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV] = {};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 210;
        const float d = f16(b + 208);
        const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192);
        int8_t q[256];
        for (int h = 0; h < 2; h++) {
            for (int j = 0; j < 4; j++) {
                for (int l = 0; l < 32; l++) {
                    const int lo = (b[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) & 0xf;
                    const int hi = (b[128 + 32 * h + l] >> (2 * j)) & 3;
                    q[128 * h + 32 * j + l] = static_cast<int8_t>((lo | hi << 4) - 32);
                }
            }
        }
        for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            int sumi = 0;
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int l = 0; l < 16; l++) s += q[16 * g + l] * a.qs[16 * g + l];
                sumi += sc[g] * s;
            }
            acc[v] += a.d * d * static_cast<float>(sumi);
        }
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

#ifdef PEBBLE_X86
template <int K, int NV>
AVX2 void dot_k45_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = K == k_q4_k ? 144 : 176;
    __m256 acc[NV];
    float macc[NV];
    UNROLL for (int v = 0; v < NV; v++) {
        acc[v] = _mm256_setzero_ps();
        macc[v] = 0.0f;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        const float d = f16c(b), dmin = f16c(b + 2);
        alignas(16) uint32_t sm[4];
        unpack_scales_k4(b + 4, sm);
        const uint8_t * scales = reinterpret_cast<const uint8_t *>(sm);
        const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm + 2)));
        const uint8_t * qs = b + (K == k_q4_k ? 16 : 48);
        __m256i qh = _mm256_setzero_si256();
        if constexpr (K == k_q5_k) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16));
        __m256i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm256_setzero_si256();
        UNROLL for (int p = 0; p < 4; p++) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * p));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if constexpr (K == k_q5_k) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            const __m256i s_lo = _mm256_set1_epi16(static_cast<int16_t>(scales[2 * p]));
            const __m256i s_hi = _mm256_set1_epi16(static_cast<int16_t>(scales[2 * p + 1]));
            UNROLL for (int v = 0; v < NV; v++) {
                const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 64 * p));
                const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 64 * p + 32));
                sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), s_lo));
                sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), s_hi));
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            // sum over sub-blocks j of min_j * (sum of x's 32 q): pairs of the 16-element sums, then madd
            const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a.sums));
            const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a.sums + 8));
            const __m128i prod = _mm_madd_epi16(mins16, _mm_hadd_epi16(s0, s1));
            __m128i t = _mm_add_epi32(prod, _mm_shuffle_epi32(prod, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            const float ad = a.d;
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(ad * d), _mm256_cvtepi32_ps(sumi[v]), acc[v]);
            macc[v] += ad * dmin * static_cast<float>(_mm_cvtsi128_si32(t));
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]) - macc[v];
}

template <int NV>
AVX2 void dot_q6_k_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    __m256 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 210;
        const float d = f16c(b + 208);
        const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(sc)));
        __m256i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) {
            // the -32 of every q, through x's 16-element sums: -32 * sum_g scale_g * sums_g
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.sums)));
            sumi[v] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5));
        }
        UNROLL for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * h));
            // unsigned 0..63; the -32 is taken off above
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0c)), 2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(static_cast<char>(0xc0))), 2)),
            };
            UNROLL for (int j = 0; j < 4; j++) {
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * j + 1]), _mm_set1_epi16(sc[8 * h + 2 * j]));
                UNROLL for (int v = 0; v < NV; v++) {
                    const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 128 * h + 32 * j));
                    sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], y), s));
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(a.d * d), _mm256_cvtepi32_ps(sumi[v]), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]);
}

AVX512 inline __m512i pair_256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 32 words: the first 16 word a of v, the last 16 word b (an index for vpermw).
AVX512 inline __m512i word_index(int a, int b) {
    return pair_256(_mm256_set1_epi16(static_cast<int16_t>(a)), _mm256_set1_epi16(static_cast<int16_t>(b)));
}

// out[v] = the sum of acc[v]'s 16 lanes, v < NV, in _mm512_reduce_add_ps's order (the halves added, then
// the quarters, then lanes 0 + 2 and 1 + 3, then those two), so that a row's sum is the same whatever
// NV. Several are reduced together, transposed: the shuffles and adds that one takes alone give 8.
template <int NV>
AVX512 __attribute__((always_inline)) inline void reduce_store(const __m512 * acc, float * out) {
    if constexpr (NV == 1) {
        out[0] = _mm512_reduce_add_ps(acc[0]);
    } else {
        __m512 a[8], s[4], t[2];
        UNROLL for (int v = 0; v < 8; v++) a[v] = v < NV ? acc[v] : _mm512_setzero_ps();
        UNROLL for (int p = 0; p < 4; p++) { // [a(2p) halves added | a(2p+1) halves added]
            s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        }
        UNROLL for (int p = 0; p < 2; p++) { // quarter k: a(4p + k)'s quarters added
            t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        }
        // quarter k: (0 + 2, 1 + 3) of a(k), then of a(k + 4); then each pair added
        const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
        const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
        // lane 4k holds a(k)'s sum, lane 4k + 1 a(k + 4)'s
        const __m512 sums = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), z);
        _mm256_mask_storeu_ps(out, static_cast<__mmask8>((1u << NV) - 1), _mm512_castps512_ps256(sums));
    }
}

// 128 quants of block i, unsigned, as two registers of 64 (lo: x's q at `at`, hi: at `at` + 64), times
// each of NV activations, each 16-bit pair sum times its scale (s_lo, s_hi), added to sumi[v].
template <int NV>
AVX512 __attribute__((always_inline)) inline void dot_128(__m512i * sumi, __m512i lo, __m512i hi, __m512i s_lo,
                                                          __m512i s_hi, const uint8_t * xq, int64_t xs, int64_t i,
                                                          int at) {
    UNROLL for (int v = 0; v < NV; v++) {
        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
        const __m512i y0 = _mm512_load_si512(a.qs + at), y1 = _mm512_load_si512(a.qs + at + 64);
        sumi[v] = _mm512_dpwssd_epi32(sumi[v], _mm512_maddubs_epi16(lo, y0), s_lo);
        sumi[v] = _mm512_dpwssd_epi32(sumi[v], _mm512_maddubs_epi16(hi, y1), s_hi);
    }
}

template <int K, int NV>
AVX512 void dot_k45_avx512(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = K == k_q4_k ? 144 : 176;
    __m512 acc[NV];
    __m256 accm[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps(), accm[v] = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    // the scale of each 16-bit sum: registers hold sub-blocks (4c, 4c+2) and (4c+1, 4c+3)
    const __m512i index[4] = {word_index(0, 2), word_index(1, 3), word_index(4, 6), word_index(5, 7)};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        const float d = _cvtsh_ss(u16(b)), dmin = _cvtsh_ss(u16(b + 2));
        uint32_t sm[4];
        unpack_scales_k4(b + 4, sm);
        const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm))));
        // each sub-block's min twice, beside x's two 16-element sums of that sub-block
        const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm + 2)));
        const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mins16, mins16), _mm_unpacklo_epi16(mins16, mins16));
        const uint8_t * qs = b + (K == k_q4_k ? 16 : 48);
        __m512i qh = _mm512_setzero_si512();
        if constexpr (K == k_q5_k) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16));
            qh = pair_256(h, _mm256_srli_epi16(h, 2));
        }
        __m512i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm512_setzero_si512();
        UNROLL for (int c = 0; c < 2; c++) {
            const __m512i raw = _mm512_loadu_si512(qs + 64 * c);
            __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            if constexpr (K == k_q5_k) {
                lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(qh, one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 1), one), 4));
                qh = _mm512_srli_epi16(qh, 4);
            }
            const __m512i s_lo = _mm512_permutexvar_epi16(index[2 * c], scales);
            const __m512i s_hi = _mm512_permutexvar_epi16(index[2 * c + 1], scales);
            dot_128<NV>(sumi, lo, hi, s_lo, s_hi, xq, xs, i, 128 * c);
        }
        const __m512 dv = _mm512_set1_ps(d);
        const __m256 mdv = _mm256_set1_ps(-dmin);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
            // min_j * (sum of x's 32 q of sub-block j), per j, taken off in an accumulator of its own (eight
            // lanes: AVX-512 units that run a 512-bit operation as two halves take it in one)
            const __m256i m = _mm256_madd_epi16(mins, _mm256_load_si256(reinterpret_cast<const __m256i *>(a.sums)));
            acc[v] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(a.d)), _mm512_cvtepi32_ps(sumi[v]), acc[v]);
            accm[v] = _mm256_fmadd_ps(_mm256_mul_ps(mdv, _mm256_set1_ps(a.d)), _mm256_cvtepi32_ps(m), accm[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_add_ps(acc[v], _mm512_zextps256_ps512(accm[v]));
    reduce_store<NV>(acc, out);
}

// Q6_K block b (block i of the row) times NV activations as integers: the lanes of sumi[v] add up to the
// block's sum of scale_g * (q - 32) * x's q; d its scale.
template <int NV>
AVX512 __attribute__((always_inline)) inline float q6_k_block_ints(const uint8_t * b, const uint8_t * xq, int64_t xs,
                                                                   int64_t i, __m512i * sumi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
    // the scale of each 16-bit sum: a register holds 4 groups of 16, 8 sums each
    const __m512i group = _mm512_srli_epi16(
        _mm512_set_epi32(0x001f001e, 0x001d001c, 0x001b001a, 0x00190018, 0x00170016, 0x00150014, 0x00130012,
                         0x00110010, 0x000f000e, 0x000d000c, 0x000b000a, 0x00090008, 0x00070006, 0x00050004,
                         0x00030002, 0x00010000), 3);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 192)));
    const __m512i scales = _mm512_castsi256_si512(sc16);
    UNROLL for (int v = 0; v < NV; v++) {
        // the -32 of every q, through x's 16-element sums: -32 * sum_g scale_g * sums_g
        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
        const __m256i corr = _mm256_madd_epi16(sc16, _mm256_load_si256(reinterpret_cast<const __m256i *>(a.sums)));
        sumi[v] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5)));
    }
    UNROLL for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m256i qh256 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * h));
        const __m512i qh = pair_256(qh256, _mm256_srli_epi16(qh256, 2));
        // unsigned 0..63, elements 128h + 0..63 and 128h + 64..127; the -32 is taken off above
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(qh, m2), 4));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), m2), 4));
        const __m512i s_lo = _mm512_permutexvar_epi16(_mm512_add_epi16(group, _mm512_set1_epi16(static_cast<int16_t>(8 * h))), scales);
        const __m512i s_hi = _mm512_permutexvar_epi16(_mm512_add_epi16(group, _mm512_set1_epi16(static_cast<int16_t>(8 * h + 4))), scales);
        dot_128<NV>(sumi, lo, hi, s_lo, s_hi, xq, xs, i, 128 * h);
    }
    return _cvtsh_ss(u16(b + 208));
}

// Q4_K: sub-block j's 32 quants times x, a 32-bit integer per row, times the row's 6-bit scale of j, added
// up over the block; then d and dmin (each row's, in lanes) times x's d. vpdpwssd multiplies the low
// 16-bit half of each lane by the scale: a sum over 16 quants (at most 16 * 15 * 127) fits it, so each
// sub-block is two sums of 16. The mins: dmin * m_j * (x's sum over j), through x's sums of 16 in pairs.
// x shifted left by n bits (right by -n), in 32-bit lanes: a byte's bit k to bit k + n.
AVX512 __attribute__((always_inline)) inline __m512i shift_bits(__m512i x, int n) {
    return n >= 0 ? _mm512_slli_epi32(x, n) : _mm512_srli_epi32(x, -n);
}

// A group's block head: d and dmin a lane each, and unpack_scales_k4's scales (sc) and mins (mn) a byte each
// (scales 0..3, 4..7; mins 0..3, 4..7), each row a lane.
struct k45_head { __m512 d, dmin; __m512i sc[2], mn[2]; };

AVX512 __attribute__((always_inline)) inline k45_head k45_head_of(const uint8_t * b, int64_t rb) {
    const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f),
                  top2 = _mm512_set1_epi32(0x03030303);
    __m512i h[4]; // d | dmin, then the twelve bytes of scales and mins
    load_16x4(b, rb, h);
    return {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0])), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16))),
            {_mm512_and_si512(h[1], low6),
             _mm512_or_si512(_mm512_and_si512(h[3], low4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[1], 6), top2), 4))},
            {_mm512_and_si512(h[2], low6),
             _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h[3], 4), low4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[2], 6), top2), 4))}};
}

// Sub-blocks 2c (low nibbles) and 2c + 1 (high), quants 16 * half .. + 15: q[0..3] and q[4..7] (Q5_K's fifth bits
// from qhb[half], the high-bit bytes 16 * half .. + 15, as bit 4); returns their two scales (s[0], s[1]).
template <int K>
AVX512 __attribute__((always_inline)) inline void k45_quants(const uint8_t * b, int64_t rb, const k45_head & h,
                                                             const __m512i (&qhb)[2][4], int c, int half, __m512i q[8],
                                                             __m512i s[2]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), byte = _mm512_set1_epi32(0xff);
    s[0] = _mm512_and_si512(_mm512_srli_epi32(h.sc[c / 2], 16 * (c % 2)), byte);
    s[1] = _mm512_and_si512(_mm512_srli_epi32(h.sc[c / 2], 16 * (c % 2) + 8), byte);
    __m512i t[4];
    load_16x4(b + (K == k_q4_k ? 16 : 48) + 32 * c + 16 * half, rb, t);
    UNROLL for (int m = 0; m < 4; m++) {
        q[m] = _mm512_and_si512(t[m], m4);
        q[4 + m] = _mm512_and_si512(_mm512_srli_epi16(t[m], 4), m4);
        if constexpr (K == k_q5_k) { // bits 2c and 2c + 1 of the high-bit bytes, as bit 4
            q[m] = _mm512_or_si512(q[m], _mm512_and_si512(shift_bits(qhb[half][m], 4 - 2 * c), _mm512_set1_epi8(0x10)));
            q[4 + m] = _mm512_or_si512(q[4 + m], _mm512_and_si512(shift_bits(qhb[half][m], 3 - 2 * c), _mm512_set1_epi8(0x10)));
        }
    }
}

// One vector's sum of k45_quants' two sub-block halves, each times its scale, added to sumi.
template <int K>
AVX512 __attribute__((always_inline)) inline __m512i k45_add(__m512i sumi, const __m512i q[8], const __m512i s[2],
                                                             const q8_k512 & a, int c, int half) {
    // where x's q of sub-block s sit: quantize_k512's paired order (0 2 1 3 4 6 5 7, its own inverse)
    constexpr int pos[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    const int8_t * xl = a.qs + 32 * pos[2 * c] + 16 * half, * xh = a.qs + 32 * pos[2 * c + 1] + 16 * half;
    __m512i pl = _mm512_setzero_si512(), ph = _mm512_setzero_si512();
    UNROLL for (int m = 0; m < 4; m++) {
        pl = _mm512_dpbusd_epi32(pl, q[m], _mm512_set1_epi32(dword_at(xl + 4 * m)));
        ph = _mm512_dpbusd_epi32(ph, q[4 + m], _mm512_set1_epi32(dword_at(xh + 4 * m)));
    }
    if constexpr (K == k_q4_k) return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sumi, pl, s[0]), ph, s[1]);
    // a sum of 16 five-bit quants reaches 16 * 31 * 127, past vpdpwssd's 16 bits
    return _mm512_add_epi32(sumi, _mm512_add_epi32(_mm512_mullo_epi32(pl, s[0]), _mm512_mullo_epi32(ph, s[1])));
}

// m_j in both 16-bit halves of a lane (beside x's two sums of 16 in sub-block j), and one vector's sum of them.
AVX512 __attribute__((always_inline)) inline void k45_mins(const k45_head & h, __m512i mins[8]) {
    UNROLL for (int j = 0; j < 8; j++) {
        const __m512i m = _mm512_and_si512(_mm512_srli_epi32(h.mn[j / 4], 8 * (j % 4)), _mm512_set1_epi32(0xff));
        mins[j] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
    }
}

AVX512 __attribute__((always_inline)) inline __m512i k45_min_sum(const __m512i mins[8], const q8_k512 & a) {
    __m512i summ = _mm512_setzero_si512();
    UNROLL for (int j = 0; j < 8; j++) {
        summ = _mm512_dpwssd_epi32(summ, mins[j], _mm512_set1_epi32(dword_at(reinterpret_cast<const int8_t *>(a.sums + 2 * j))));
    }
    return summ;
}

// Per block and row: d x's d times the integer sum, less dmin x's d times the mins' (rows16_k45's and the
// exact row kernel's two fused multiply-adds).
AVX512 __attribute__((always_inline)) inline __m512 k45_epilogue(__m512 acc, const k45_head & h, float xd, __m512i sumi,
                                                                 __m512i summ) {
    const __m512 dx = _mm512_set1_ps(xd);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(h.d, dx), _mm512_cvtepi32_ps(sumi), acc);
    return _mm512_fnmadd_ps(_mm512_mul_ps(h.dmin, dx), _mm512_cvtepi32_ps(summ), acc);
}

// Q4_K's and Q5_K's sixteen rows times a prompt's vectors (kernel_set::many, in prompt_frame), as IQ4_XS's:
// each block decoded once for up to 64 vectors, then 16 at a time, their sums in registers; the same
// integers per block and the same epilogue as rows16_k45, so the same bits.
template <int K> struct k45_block {
    k45_head h;
    __m512i  q[8][8], s[8][2], mins[8]; // q, s: [2c + half]
    template <int V> AVX512 void times(const uint8_t * xq, int64_t xs, int64_t i, float * acc) const;
};

template <int K>
template <int V>
AVX512 void k45_block<K>::times(const uint8_t * xq, int64_t xs, int64_t i, float * acc) const {
    const q8_k512 * x[V];
    __m512i sumi[V];
    UNROLL for (int v = 0; v < V; v++) x[v] = reinterpret_cast<const q8_k512 *>(xq + v * xs) + i, sumi[v] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int k = 0; k < 8; k++) {
        __m512i w[8], sk[2] = {s[k][0], s[k][1]};
        UNROLL for (int m = 0; m < 8; m++) w[m] = q[k][m];
        UNROLL for (int v = 0; v < V; v++) sumi[v] = k45_add<K>(sumi[v], w, sk, *x[v], k / 2, k % 2);
    }
    UNROLL for (int v = 0; v < V; v++) {
        _mm512_store_ps(acc + 16 * v, k45_epilogue(_mm512_load_ps(acc + 16 * v), h, x[v]->d, sumi[v], k45_min_sum(mins, *x[v])));
    }
}

template <int K> struct k45_decode {
    const uint8_t * w;
    int64_t         rb;
    AVX512 k45_block<K> operator()(int64_t i) const {
        constexpr int bb = K == k_q4_k ? 144 : 176;
        const uint8_t * b = w + i * bb;
        prefetch_next_group(w, rb, i, bb);
        k45_block<K> blk;
        blk.h = k45_head_of(b, rb);
        __m512i qhb[2][4];
        if constexpr (K == k_q5_k) load_16x4(b + 16, rb, qhb[0]), load_16x4(b + 32, rb, qhb[1]);
        UNROLL for (int k = 0; k < 8; k++) k45_quants<K>(b, rb, blk.h, qhb, k / 2, k % 2, blk.q[k], blk.s[k]);
        k45_mins(blk.h, blk.mins);
        return blk;
    }
};

template <int K>
AVX512 void k45_many(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, int64_t n, float * y, int64_t ys) {
    prompt_frame(k45_decode<K>{w, rb}, nb, xq, xs, n, y, ys);
}

template <int K, int NV>
AVX512 void rows16_k45(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, float * y,
                       int64_t ys) {
    constexpr int bb = K == k_q4_k ? 144 : 176;
    __m512 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        prefetch_next_group(w, rb, i, bb);
        const k45_head h = k45_head_of(b, rb);
        const q8_k512 * x[NV];
        __m512i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) x[v] = reinterpret_cast<const q8_k512 *>(xq + v * xs) + i, sumi[v] = _mm512_setzero_si512();
        __m512i qhb[2][4]; // Q5_K: the high-bit bytes 16 * half .. + 15, read once for the four pairs of sub-blocks
        if constexpr (K == k_q5_k) load_16x4(b + 16, rb, qhb[0]), load_16x4(b + 32, rb, qhb[1]);
        UNROLL for (int c = 0; c < 4; c++) {
            UNROLL for (int half = 0; half < 2; half++) {
                __m512i q[8], s[2];
                k45_quants<K>(b, rb, h, qhb, c, half, q, s);
                UNROLL for (int v = 0; v < NV; v++) sumi[v] = k45_add<K>(sumi[v], q, s, *x[v], c, half);
            }
        }
        __m512i mins[8];
        k45_mins(h, mins);
        UNROLL for (int v = 0; v < NV; v++) acc[v] = k45_epilogue(acc[v], h, x[v]->d, sumi[v], k45_min_sum(mins, *x[v]));
    }
    UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + v * ys, acc[v]);
}

// Q6_K: each group of 16 quants times x, less 32 times x's sum over the group (its offset), a 32-bit integer
// per row, times the row's signed 8-bit scale of the group, added up over the block; then d times x's d.
template <int NV>
AVX512 void rows16_q6_k(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, float * y,
                        int64_t ys) {
    __m512 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 210;
        prefetch_next_group(w, rb, i, 210);
        __m512i sc[4], tail[4]; // the sixteen scales; bytes 206..209, whose top half is d
        load_16x4(b + 192, rb, sc);
        load_16x4(b + 194, rb, tail);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(tail[3], 16)));
        __m512i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm512_setzero_si512();
        UNROLL for (int n = 0; n < 2; n++) {       // 128 quants: ql[64n..], qh[32n..]
            UNROLL for (int h = 0; h < 2; h++) {   // l = 16h .. 16h + 15 of each of the four runs of 32
                __m512i la[4], lb[4], qh[4], q[4][4];
                load_16x4(b + 64 * n + 16 * h, rb, la);
                load_16x4(b + 64 * n + 32 + 16 * h, rb, lb);
                load_16x4(b + 128 + 32 * n + 16 * h, rb, qh);
                UNROLL for (int m = 0; m < 4; m++) {
                    q[0][m] = _mm512_or_si512(_mm512_and_si512(la[m], m4), _mm512_slli_epi32(_mm512_and_si512(qh[m], m2), 4));
                    q[1][m] = _mm512_or_si512(_mm512_and_si512(lb[m], m4),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 2), m2), 4));
                    q[2][m] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(la[m], 4), m4),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 4), m2), 4));
                    q[3][m] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lb[m], 4), m4),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 6), m2), 4));
                }
                UNROLL for (int run = 0; run < 4; run++) { // quants 128n + 32run + 16h + ..., group 8n + 2run + h
                    const int g = 8 * n + 2 * run + h;
                    const __m512i scale = _mm512_srai_epi32(_mm512_slli_epi32(sc[g / 4], 24 - 8 * (g % 4)), 24);
                    UNROLL for (int v = 0; v < NV; v++) {
                        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
                        const int8_t * x = a.qs + 128 * n + 32 * run + 16 * h;
                        __m512i p = _mm512_set1_epi32(-32 * a.sums[g]); // the offset of 32, through x's sum
                        UNROLL for (int m = 0; m < 4; m++) p = _mm512_dpbusd_epi32(p, q[run][m], _mm512_set1_epi32(dword_at(x + 4 * m)));
                        sumi[v] = _mm512_add_epi32(sumi[v], _mm512_mullo_epi32(p, scale));
                    }
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
            acc[v] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.d)), _mm512_cvtepi32_ps(sumi[v]), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + v * ys, acc[v]);
}

// Q4_K block b (block i of the row) times NV activations as integers: the lanes of sumi[v] add up to the
// block's sum_j scale_j * S_j (S_j: sub-block j's quants times x's q), those of msum[v] to its
// sum_j min_j * (x's sum over sub-block j); d and dmin its scales.
template <int K, int NV>
AVX512 __attribute__((always_inline)) inline void k45_block_ints(const uint8_t * b, const uint8_t * xq, int64_t xs,
                                                                 int64_t i, __m512i * sumi, __m256i * msum,
                                                                 float & d, float & dmin) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    const __m512i index[4] = {word_index(0, 2), word_index(1, 3), word_index(4, 6), word_index(5, 7)};
    d = _cvtsh_ss(u16(b));
    dmin = _cvtsh_ss(u16(b + 2));
    uint32_t sm[4];
    unpack_scales_k4(b + 4, sm);
    const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm))));
    const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(sm + 2)));
    const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mins16, mins16), _mm_unpacklo_epi16(mins16, mins16));
    UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm512_setzero_si512();
    __m512i qh = _mm512_setzero_si512(); // Q5_K's fifth bits, as dot_k45_avx512 takes them
    if constexpr (K == k_q5_k) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16));
        qh = pair_256(h, _mm256_srli_epi16(h, 2));
    }
    UNROLL for (int c = 0; c < 2; c++) {
        const __m512i raw = _mm512_loadu_si512(b + (K == k_q4_k ? 16 : 48) + 64 * c);
        __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        if constexpr (K == k_q5_k) {
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(qh, one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 1), one), 4));
            qh = _mm512_srli_epi16(qh, 4);
        }
        dot_128<NV>(sumi, lo, hi, _mm512_permutexvar_epi16(index[2 * c], scales),
                    _mm512_permutexvar_epi16(index[2 * c + 1], scales), xq, xs, i, 128 * c);
    }
    UNROLL for (int v = 0; v < NV; v++) {
        const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
        msum[v] = _mm256_madd_epi16(mins, _mm256_load_si256(reinterpret_cast<const __m256i *>(a.sums)));
    }
}

// Q4_K and Q6_K row by row (a matrix's last rows, past its whole groups of 16): per block the integer
// sums, then the fused multiply-adds of rows16_q4_k's and rows16_q6_k's lanes, so that a row's result is
// the same bits whichever kernel took it.
template <int K, int NV>
AVX512 void dot_k_exact_avx512(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        __m512i sumi[NV];
        __m256i msum[NV];
        float d, dmin = 0.0f;
        if constexpr (K == k_q6_k) d = q6_k_block_ints<NV>(w + i * 210, xq, xs, i, sumi);
        else k45_block_ints<K, NV>(w + i * (K == k_q4_k ? 144 : 176), xq, xs, i, sumi, msum, d, dmin);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_k512 & a = reinterpret_cast<const q8_k512 *>(xq + v * xs)[i];
            acc[v] = std::fma(d * a.d, static_cast<float>(_mm512_reduce_add_epi32(sumi[v])), acc[v]);
            if constexpr (K != k_q6_k) {
                acc[v] = std::fma(-(dmin * a.d), static_cast<float>(_mm512_reduce_add_epi32(_mm512_zextsi256_si512(msum[v]))), acc[v]);
            }
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// The sums of a, b, c and d's lanes, in lanes 0..3 (integers: exact in any order).
AVX512 __attribute__((always_inline)) inline __m128i sum4_lanes(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

AVX512 __attribute__((always_inline)) inline __m256i fold_512(__m512i z) {
    return _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
}

// One activation through sixteen rows of Q4_K or Q6_K, four rows at a time read in order (the prefetchers
// follow four streams; sixteen, not), to the bits of rows16_q4_k's and rows16_q6_k's lanes: per block the
// four rows' integer sums (as the row kernels make them) added up across their lanes together, then the
// same float multiply-adds, four rows a register. Qwen2.5-1.5B's decode step, against the row kernels of
// before the sixteen-row ones: a scalar epilogue per row and block (one reduction per sum) ran it 10-14%
// slower, and the sixteen-row kernel itself as slow or slower.
template <int K>
AVX512 void rows16_one_k(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t, float * y, int64_t) {
    constexpr int bb = K == k_q4_k ? 144 : K == k_q5_k ? 176 : 210;
    const q8_k512 * x = reinterpret_cast<const q8_k512 *>(xq);
    for (int r0 = 0; r0 < 16; r0 += 4) {
        __m128 acc = _mm_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            // the group two on, in order, as rows16's kernels ask for it: 4 blocks' bytes a step here
            prefetch_group_bytes(w + 16 * rb * groups_ahead + ((r0 / 4) * nb + i) * 4 * bb, 4 * bb);
            __m512i si[4];
            __m256i mi[4];
            float d[4], dm[4];
            UNROLL for (int r = 0; r < 4; r++) {
                const uint8_t * b = w + (r0 + r) * rb + i * bb;
                if constexpr (K == k_q6_k) d[r] = q6_k_block_ints<1>(b, xq, 0, i, &si[r]);
                else k45_block_ints<K, 1>(b, xq, 0, i, &si[r], &mi[r], d[r], dm[r]);
            }
            const __m128 dx = _mm_set1_ps(x[i].d);
            const __m128i s = sum4_lanes(fold_512(si[0]), fold_512(si[1]), fold_512(si[2]), fold_512(si[3]));
            acc = _mm_fmadd_ps(_mm_mul_ps(_mm_loadu_ps(d), dx), _mm_cvtepi32_ps(s), acc);
            if constexpr (K != k_q6_k) {
                const __m128i m = sum4_lanes(mi[0], mi[1], mi[2], mi[3]);
                acc = _mm_fnmadd_ps(_mm_mul_ps(_mm_loadu_ps(dm), dx), _mm_cvtepi32_ps(m), acc);
            }
        }
        _mm_storeu_ps(y + r0, acc);
    }
}
#endif

// ---------------------------------------------------------------------------------------------------
// the family's kernel sets (cpu/quants.h)

PEBBLE_DOT(k45_portable, dot_k45_portable)
template <int K> struct q6_portable { template <int NV> struct at { static constexpr dot_fn fn = dot_q6_k_portable<NV>; }; };
#ifdef PEBBLE_X86
PEBBLE_DOT(k45_avx2, dot_k45_avx2)
PEBBLE_DOT(k45_avx512, dot_k45_avx512)
template <int K> struct q6_avx2 { template <int NV> struct at { static constexpr dot_fn fn = dot_q6_k_avx2<NV>; }; };
PEBBLE_DOT(k_exact_avx512, dot_k_exact_avx512)
template <int NV> struct q4_k_rows { static constexpr rows_fn fn = NV == 1 ? rows16_one_k<k_q4_k> : rows16_k45<k_q4_k, NV>; };
template <int NV> struct q5_k_rows { static constexpr rows_fn fn = NV == 1 ? rows16_one_k<k_q5_k> : rows16_k45<k_q5_k, NV>; };
template <int NV> struct q6_k_rows { static constexpr rows_fn fn = NV == 1 ? rows16_one_k<k_q6_k> : rows16_q6_k<NV>; };
#endif

// The AVX2 and the portable kernels of a K-quant: one table, the families of row functions its arguments.
template <template <int> class K45, template <int> class Q6>
kernel_set four_at_a_time(int32_t type) {
    switch (type) {
        case 12: return set_of<K45, k_q4_k>(act::q8_256, 256, 144, 4);
        case 13: return set_of<K45, k_q5_k>(act::q8_256, 256, 176, 4);
        case 14: return set_of<Q6, 0>(act::q8_256, 256, 210, 4);
    }
    return {act::f32, 0, 0, 0, {}, {}};
}

} // namespace

kernel_set k_quant_kernels(int32_t type, simd level) {
#ifdef PEBBLE_X86
    if (level == simd::avx512) {
        switch (type) {
            case 12: {
                kernel_set k = with_rows<q4_k_rows>(set_of<k_exact_avx512, k_q4_k>(act::q8_k512_paired, 256, 144, 8), upto<8>{});
                k.many = k45_many<k_q4_k>;
                return k;
            }
            case 13: {
                kernel_set k = with_rows<q5_k_rows>(set_of<k_exact_avx512, k_q5_k>(act::q8_k512_paired, 256, 176, 8), upto<8>{});
                k.many = k45_many<k_q5_k>;
                return k;
            }
            case 14: return with_rows<q6_k_rows>(set_of<k_exact_avx512, k_q6_k>(act::q8_k512, 256, 210, 8), upto<8>{});
        }
    }
    if (level != simd::portable) return four_at_a_time<k45_avx2, q6_avx2>(type);
#endif
    (void)level;
    return four_at_a_time<k45_portable, q6_portable>(type);
}

} // namespace pebble_cpu

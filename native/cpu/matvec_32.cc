// cpu/matvec_32.cc: the CPU's row kernels for the 32-element types, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and IQ4_NL and
// MXFP4 (4-bit indices into a table of sixteen values, under an fp16 scale or a power of two): one
// weight row times up to 4 (8 on AVX-512) activations quantized to 8-bit blocks of 32, each block's integer
// dot product exact and its scales applied once: portable C++, AVX2 (vpmaddubsw / vpmaddwd) and AVX-512
// VNNI (vpdpbusd), and on AVX-512 sixteen rows at a time with the same bits for each row (rows16_32).
// cpu/matmul.cc runs them over a matrix's rows.

#include "cpu/quants.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pebble_cpu {
namespace {

template <int K, int NV>
void dot_32_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV] = {};
    for (int64_t i = 0; i < nb; i++) {
        int q[32];
        float d, m;
        decode_32<K>(w + i * block_bytes_32(K), q, d, m);
        for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            int s = 0;
            for (int l = 0; l < 32; l++) s += q[l] * a.qs[l];
            // MXFP4: its power of two times the integer first, exact where (d * x's d) could fall below float32's
            // normal range
            if constexpr (K == k_mxfp4) acc[v] += a.d * (d * static_cast<float>(s));
            else acc[v] += d * a.d * static_cast<float>(s);
            if (K == k_q4_1 || K == k_q5_1) acc[v] += m * a.d * static_cast<float>(a.sum);
        }
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

#ifdef PEBBLE_X86
// Sums of 4 products of unsigned bytes u and signed bytes s, as 8 int32 (no pair can saturate here:
// u <= 63 or, for the signed types, |u| <= 128 with |s| <= 127).
AVX2 inline __m256i dot_u8_i8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The same for two signed operands: |a| times s with a's sign.
AVX2 inline __m256i dot_i8_i8(__m256i a, __m256i s) {
    return dot_u8_i8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
}

template <int K, int NV>
AVX2 void dot_32_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr bool has_min = K == k_q4_1 || K == k_q5_1;
    __m256 acc[NV];
    float macc[NV];
    UNROLL for (int v = 0; v < NV; v++) {
        acc[v] = _mm256_setzero_ps();
        macc[v] = 0.0f;
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * block_bytes_32(K);
        const float d = K == k_mxfp4 ? e8m0_half(b[0]) : f16c(b);
        const __m256i q = decode_32_avx2<K>(b);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs));
            const __m256i p = has_min ? dot_u8_i8(q, y) : dot_i8_i8(q, y);
            if constexpr (K == k_mxfp4) acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(a.d), _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p)), acc[v]);
            else acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(p), acc[v]);
            if constexpr (has_min) macc[v] += f16c(b + 2) * a.d * static_cast<float>(a.sum);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]) + macc[v];
}

// The 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) row by row, computing what rows16_32 computes for
// each of its lanes: per block the integer S = sum of the block's integers times x's q (exact), then
// acc += (d * x's d) * S and, for Q4_1 and Q5_1, acc += m * (x's d * x's sum), two fused multiply-adds. vpdpbusd
// multiplies unsigned by signed bytes, so the signed types' integers go in as q + 128 (bits xor 0x80) and
// 128 times x's sum comes off S again.
template <int K, int NV>
AVX512 void dot_32_avx512(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr bool has_min = K == k_q4_1 || K == k_q5_1;
    constexpr int  bb = block_bytes_32(K);
    float acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + bb * i;
        __m256i q = decode_32_avx2<K>(b);
        if constexpr (!has_min) q = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
        const float d = K == k_mxfp4 ? e8m0_half(b[0]) : _cvtsh_ss(u16(b)), m = has_min ? _cvtsh_ss(u16(b + 2)) : 0.0f;
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs)));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(p)) - (has_min ? 0 : 128 * a.sum);
            if constexpr (K == k_mxfp4) acc[v] = std::fma(a.d, d * static_cast<float>(sum), acc[v]);
            else acc[v] = std::fma(d * a.d, static_cast<float>(sum), acc[v]);
            if constexpr (has_min) acc[v] = std::fma(m, a.d * static_cast<float>(a.sum), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = acc[v];
}

// The 32-element types: S per row (the block's integers times x's q: unsigned quants from dpbusd, less
// x's sum times what they lie above the integers: 8 for Q4_0, 16 for Q5_0, 128 for Q8_0 taken as q + 128),
// then dot_32_avx512's two multiply-adds. The block's first dword (d, m or the first of qh) of each row
// is gathered; the quants transposed.
template <int K, int NV>
AVX512 void rows16_32(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, float * y,
                      int64_t ys) {
    constexpr bool has_min = K == k_q4_1 || K == k_q5_1;
    constexpr int  bb = block_bytes_32(K);
    constexpr bool lookup = K == k_iq4_nl || K == k_mxfp4; // nibbles that index a table of values
    constexpr int  at = quants_at_32(K);
    constexpr int  above = K == k_q4_0 ? 8 : K == k_q5_0 ? 16 : K == k_q8_0 || lookup ? 128 : 0;
    // bits (4 of them) to bytes of 0x10: a permutation's table, indexed by the low 4 bits of each lane
    const __m512i fifth = _mm512_setr_epi32(0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010,
                                            0x00101000, 0x00101010, 0x10000000, 0x10000010, 0x10001000, 0x10001010,
                                            0x10100000, 0x10100010, 0x10101000, 0x10101010);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int32_t>(rb)));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        prefetch_next_group(w, rb, i, bb);
        const __m512i head = _mm512_i32gather_epi32(rows, b, 1);
        __m512 d;
        if constexpr (K == k_mxfp4) { // e8m0_half, a lane a row: 2^(e - 128), subnormal for e < 2
            const __m512i e = _mm512_and_si512(head, _mm512_set1_epi32(0xff));
            const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
            const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
            d = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, subnormal));
        } else {
            d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        }
        __m512 m = _mm512_setzero_ps();
        if constexpr (has_min) m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        __m512i q[8]; // q[k] lane r: quants 4k .. 4k + 3 of row r
        if constexpr (K == k_q8_0) {
            load_16x4(b + 2, rb, q);
            load_16x4(b + 18, rb, q + 4);
            UNROLL for (int k = 0; k < 8; k++) q[k] = _mm512_xor_si512(q[k], _mm512_set1_epi8(static_cast<char>(0x80)));
        } else {
            __m512i t[4];
            load_16x4(b + at, rb, t);
            UNROLL for (int k = 0; k < 4; k++) {
                q[k] = _mm512_and_si512(t[k], m4);
                q[k + 4] = _mm512_and_si512(_mm512_srli_epi16(t[k], 4), m4);
            }
            if constexpr (lookup) { // each value + 128, unsigned for vpdpbusd (taken off through x's sum)
                const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i *>(
                                                           K == k_iq4_nl ? iq4_values.v : mxfp4_values.v))),
                                                       _mm512_set1_epi8(static_cast<char>(0x80)));
                UNROLL for (int k = 0; k < 8; k++) q[k] = _mm512_shuffle_epi8(table, q[k]);
            }
            if constexpr (K == k_q5_0 || K == k_q5_1) {
                const __m512i qh = _mm512_i32gather_epi32(rows, b + at - 4, 1);
                UNROLL for (int k = 0; k < 8; k++) {
                    q[k] = _mm512_or_si512(q[k], _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * k), fifth));
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            __m512i p = _mm512_set1_epi32(-above * a.sum);
            UNROLL for (int k = 0; k < 8; k++) p = _mm512_dpbusd_epi32(p, q[k], _mm512_set1_epi32(dword_at(a.qs + 4 * k)));
            if constexpr (K == k_mxfp4) acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(a.d), _mm512_mul_ps(d, _mm512_cvtepi32_ps(p)), acc[v]);
            else acc[v] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.d)), _mm512_cvtepi32_ps(p), acc[v]);
            if constexpr (has_min) acc[v] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.d * static_cast<float>(a.sum)), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + v * ys, acc[v]);
}
#endif

// ---------------------------------------------------------------------------------------------------
// the family's kernel sets (cpu/quants.h)

PEBBLE_DOT(dot32_portable, dot_32_portable)
#ifdef PEBBLE_X86
PEBBLE_DOT(dot32_avx2, dot_32_avx2)
PEBBLE_DOT(dot32_avx512, dot_32_avx512)
// (for one activation too: SmolLM2's Q4_1 decode step 6.96 -> 5.91 ms, Gemma-3's Q5_0/Q8_0 11.9 -> 9.4)
template <int K> struct rows32 { template <int NV> struct at { static constexpr rows_fn fn = rows16_32<K, NV>; }; };
#endif

// The AVX2 and the portable kernels of a 32-element type: one table, the family of row functions its
// argument.
template <template <int> class Dot32>
kernel_set four_at_a_time(int32_t type) {
    switch (type) {
        case 2:  return set_of<Dot32, k_q4_0>(act::q8_32, 32, 18, 4);
        case 3:  return set_of<Dot32, k_q4_1>(act::q8_32, 32, 20, 4);
        case 6:  return set_of<Dot32, k_q5_0>(act::q8_32, 32, 22, 4);
        case 7:  return set_of<Dot32, k_q5_1>(act::q8_32, 32, 24, 4);
        case 8:  return set_of<Dot32, k_q8_0>(act::q8_32, 32, 34, 4);
        case 20: return set_of<Dot32, k_iq4_nl>(act::q8_32, 32, 18, 4);
        case 39: return set_of<Dot32, k_mxfp4>(act::q8_32, 32, 17, 4);
    }
    return {act::f32, 0, 0, 0, {}, {}};
}

} // namespace

kernel_set block32_kernels(int32_t type, simd level) {
#ifdef PEBBLE_X86
    if (level == simd::avx512) {
        switch (type) {
            case 2:  return with_rows<rows32<k_q4_0>::template at>(set_of<dot32_avx512, k_q4_0>(act::q8_32, 32, 18, 8), upto<8>{});
            case 3:  return with_rows<rows32<k_q4_1>::template at>(set_of<dot32_avx512, k_q4_1>(act::q8_32, 32, 20, 8), upto<8>{});
            case 6:  return with_rows<rows32<k_q5_0>::template at>(set_of<dot32_avx512, k_q5_0>(act::q8_32, 32, 22, 8), upto<8>{});
            case 7:  return with_rows<rows32<k_q5_1>::template at>(set_of<dot32_avx512, k_q5_1>(act::q8_32, 32, 24, 8), upto<8>{});
            case 8:  return with_rows<rows32<k_q8_0>::template at>(set_of<dot32_avx512, k_q8_0>(act::q8_32, 32, 34, 8), upto<8>{});
            case 20: return with_rows<rows32<k_iq4_nl>::template at>(set_of<dot32_avx512, k_iq4_nl>(act::q8_32, 32, 18, 8), upto<8>{});
            case 39: return with_rows<rows32<k_mxfp4>::template at>(set_of<dot32_avx512, k_mxfp4>(act::q8_32, 32, 17, 8), upto<8>{});
        }
    }
    if (level != simd::portable) return four_at_a_time<dot32_avx2>(type);
#endif
    (void)level;
    return four_at_a_time<dot32_portable>(type);
}

} // namespace pebble_cpu

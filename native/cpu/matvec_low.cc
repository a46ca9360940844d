// cpu/matvec_low.cc: the CPU's row kernels for the types people pick to fit a model in less memory: Q2_K and
// Q3_K (256-element super-blocks of 2- and 3-bit quants with 4- and 6-bit sub-block scales), IQ4_XS (a
// 256-element block of eight 32-element sub-blocks, each a 6-bit scale and 4-bit indices into a table of
// sixteen non-uniform values) and the 32-element IQ4_NL (that table under one fp16 scale) and MXFP4 (the
// e2m1 table, doubled to integers, under a power-of-two scale). One weight row times up to 4 (8 on AVX-512)
// activations quantized to 8-bit blocks (of 256 with each 16's sum for the 256-element types, of 32 with
// their sum for the others), each sub-block's integer dot product exact and its scale applied once:
// portable C++, AVX2 (vpmaddubsw / vpmaddwd) and AVX-512 VNNI (vpdpbusd / vpdpwssd). cpu/matmul.cc runs
// them over a matrix's rows. The values are gguf-py's dequantizers' (cuda/quants.cuh decodes them alike).

#include "cpu/quants.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pebble_cpu {
namespace {

enum low_kind { l_q2_k, l_q3_k, l_iq4_xs, l_iq4_nl, l_mxfp4 };

constexpr int low_block_bytes(int k) {
    return k == l_q2_k ? 84 : k == l_q3_k ? 110 : k == l_iq4_xs ? 136 : k == l_iq4_nl ? 18 : 17;
}
constexpr int low_block_elements(int k) { return k == l_iq4_nl || k == l_mxfp4 ? 32 : 256; }

// IQ4_NL's and IQ4_XS's sixteen values, and MXFP4's e2m1 values doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 and
// their negatives, times two: integers, with the scale halved to match, as gguf-py's MXFP4 does).
alignas(16) constexpr int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
alignas(16) constexpr int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// MXFP4's scale byte e (E8M0) as gguf-py's e8m0_to_fp32_half reads it: 2^(e - 128), the two smallest as
// float32 subnormals.
inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Q3_K's sixteen 6-bit scales, each less 32: the low four bits of byte g % 8 (its high nibble for g >= 8)
// of the first eight bytes, the high two bits from byte 8 + g % 4, bits 2 (g / 4) up.
inline void q3_k_scales(const uint8_t * s, int8_t out[16]) {
    uint32_t w[3];
    std::memcpy(w, s, 12);
    uint32_t v[4];
    v[0] = (w[0] & 0x0f0f0f0f) | ((w[2] & 0x03030303) << 4);
    v[1] = (w[1] & 0x0f0f0f0f) | (((w[2] >> 2) & 0x03030303) << 4);
    v[2] = ((w[0] >> 4) & 0x0f0f0f0f) | (((w[2] >> 4) & 0x03030303) << 4);
    v[3] = ((w[1] >> 4) & 0x0f0f0f0f) | (((w[2] >> 6) & 0x03030303) << 4);
    uint8_t bytes[16];
    std::memcpy(bytes, v, 16);
    for (int g = 0; g < 16; g++) out[g] = static_cast<int8_t>(bytes[g] - 32);
}

// IQ4_XS's eight 6-bit scales, each less 32: a nibble of bytes 4..7 (sub-block j's is byte 4 + j / 2's,
// low first) below two bits of the 16-bit word at byte 2 (bits 2j, 2j + 1).
inline void iq4_xs_scales(const uint8_t * b, int out[8]) {
    const int high = b[2] | b[3] << 8;
    for (int j = 0; j < 8; j++) out[j] = (((b[4 + j / 2] >> (4 * (j % 2))) & 0xf) | (((high >> (2 * j)) & 3) << 4)) - 32;
}

// ---------------------------------------------------------------------------------------------------
// portable: each block decoded to integers once, then multiplied by every activation

// A 256-element block as integers q (element order) and each 16's integer scale: value d * scale * q
// (less dmin * min for Q2_K: its 4-bit mins in mn).
template <int K>
void decode_256(const uint8_t * b, int8_t * q, int * scale, int * mn) {
    if constexpr (K == l_q2_k) { // scales at 0, quants at 16: element 128n + 32j + l is bits 2j of byte 16 + 32n + l
        for (int g = 0; g < 16; g++) scale[g] = b[g] & 0xf, mn[g] = b[g] >> 4;
        for (int n = 0; n < 2; n++) {
            for (int j = 0; j < 4; j++) {
                for (int l = 0; l < 32; l++) q[128 * n + 32 * j + l] = static_cast<int8_t>((b[16 + 32 * n + l] >> (2 * j)) & 3);
            }
        }
    } else if constexpr (K == l_q3_k) { // high bits at 0 (element 32k + l's: bit k of byte l), quants at 32
        int8_t s[16];
        q3_k_scales(b + 96, s);
        for (int g = 0; g < 16; g++) scale[g] = s[g], mn[g] = 0;
        for (int n = 0; n < 2; n++) {
            for (int j = 0; j < 4; j++) {
                for (int l = 0; l < 32; l++) {
                    const int low = (b[32 + 32 * n + l] >> (2 * j)) & 3, high = (b[l] >> (4 * n + j)) & 1;
                    q[128 * n + 32 * j + l] = static_cast<int8_t>(low - (high ? 0 : 4));
                }
            }
        }
    } else { // IQ4_XS: sub-block j's 16 bytes at 8 + 16j, elements l < 16 the low nibbles, 16 + l the high
        int s[8];
        iq4_xs_scales(b, s);
        for (int g = 0; g < 16; g++) scale[g] = s[g / 2], mn[g] = 0;
        for (int j = 0; j < 8; j++) {
            for (int l = 0; l < 16; l++) {
                q[32 * j + l] = iq4_values[b[8 + 16 * j + l] & 0xf];
                q[32 * j + 16 + l] = iq4_values[b[8 + 16 * j + l] >> 4];
            }
        }
    }
}

template <int K, int NV>
void dot_low_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = low_block_bytes(K);
    float acc[NV] = {};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        if constexpr (low_block_elements(K) == 32) {
            const int8_t * table = K == l_iq4_nl ? iq4_values : mxfp4_values;
            const uint8_t * qs = b + (K == l_iq4_nl ? 2 : 1);
            int q[32];
            for (int l = 0; l < 16; l++) q[l] = table[qs[l] & 0xf], q[l + 16] = table[qs[l] >> 4];
            for (int v = 0; v < NV; v++) {
                const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
                int s = 0;
                for (int l = 0; l < 32; l++) s += q[l] * a.qs[l];
                // MXFP4: its power of two times the integer first (exact), then x's scale
                if constexpr (K == l_iq4_nl) acc[v] += f16(b) * a.d * static_cast<float>(s);
                else acc[v] += a.d * (e8m0_half(b[0]) * static_cast<float>(s));
            }
        } else {
            int8_t q[256];
            int scale[16], mn[16];
            decode_256<K>(b, q, scale, mn);
            const float d = f16(b + (K == l_q2_k ? 80 : K == l_q3_k ? 108 : 0));
            for (int v = 0; v < NV; v++) {
                const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                int sumi = 0, summ = 0;
                for (int g = 0; g < 16; g++) {
                    int s = 0;
                    for (int l = 0; l < 16; l++) s += q[16 * g + l] * a.qs[16 * g + l];
                    sumi += scale[g] * s;
                    summ += mn[g] * a.sums[g];
                }
                acc[v] += a.d * d * static_cast<float>(sumi);
                if constexpr (K == l_q2_k) acc[v] -= a.d * f16(b + 82) * static_cast<float>(summ);
            }
        }
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

#ifdef PEBBLE_X86
// ---------------------------------------------------------------------------------------------------
// AVX2: 32 quants a register; vpmaddubsw's pairs cannot saturate (unsigned quants <= 7 against |x| <= 127;
// the tables' values go in as their magnitudes against x with their signs, |value| <= 127)

AVX2 inline __m256i maddubs_signed(__m256i value, __m256i x) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(value, value), _mm256_sign_epi8(x, value));
}

// 16-bit lanes 0..7 the scale of sub-block g, 8..15 that of g + 1, from 16 int16 scales (the high lane
// holding 8..15): vpshufb within the 128-bit lane that holds them.
AVX2 inline __m256i scale_pair(__m256i scales16, int g) {
    const __m128i half = g < 8 ? _mm256_castsi256_si128(scales16) : _mm256_extracti128_si256(scales16, 1);
    const int at = 2 * (g % 8);
    const __m128i lo = _mm_set1_epi16(static_cast<int16_t>(at | (at + 1) << 8));
    const __m128i hi = _mm_set1_epi16(static_cast<int16_t>((at + 2) | (at + 3) << 8));
    return _mm256_set_m128i(_mm_shuffle_epi8(half, hi), _mm_shuffle_epi8(half, lo));
}

template <int K, int NV>
AVX2 void dot_k23_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = low_block_bytes(K);
    __m256 acc[NV];
    float macc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps(), macc[v] = 0.0f;
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        __m256i scales16, mins16 = _mm256_setzero_si256(), hm = _mm256_setzero_si256();
        float d, dmin = 0.0f;
        if constexpr (K == l_q2_k) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b));
            scales16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f)));
            mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f)));
            d = f16c(b + 80), dmin = f16c(b + 82);
        } else {
            alignas(16) int8_t s[16];
            q3_k_scales(b + 96, s);
            scales16 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i *>(s)));
            hm = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b));
            d = f16c(b + 108);
        }
        const uint8_t * qs = b + (K == l_q2_k ? 16 : 32);
        __m256i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            if constexpr (K == l_q3_k) { // the quants go in as 0..7, 4 above their values: -4 * sum_g scale_g * x's sum_g
                const __m256i corr = _mm256_madd_epi16(scales16, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.sums)));
                sumi[v] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 2));
            } else {
                sumi[v] = _mm256_setzero_si256();
            }
        }
        UNROLL for (int n = 0; n < 2; n++) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * n));
            UNROLL for (int j = 0; j < 4; j++) { // elements 128n + 32j .. + 31: sub-blocks 8n + 2j, 8n + 2j + 1
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * j), m2);
                if constexpr (K == l_q3_k) {
                    q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * n + j), one), 2));
                }
                const __m256i s = scale_pair(scales16, 8 * n + 2 * j);
                UNROLL for (int v = 0; v < NV; v++) {
                    const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 128 * n + 32 * j));
                    sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), s));
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(a.d * d), _mm256_cvtepi32_ps(sumi[v]), acc[v]);
            if constexpr (K == l_q2_k) {
                const __m256i summ = _mm256_madd_epi16(mins16, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.sums)));
                macc[v] += a.d * dmin * static_cast<float>(hsum_epi32(summ));
            }
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]) - macc[v];
}

// 32 nibbles in element order (the low nibbles of 16 bytes, then their high nibbles) through a table.
AVX2 inline __m256i lookup_32(const uint8_t * qs, __m256i table) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_shuffle_epi8(table, _mm256_and_si256(both, _mm256_set1_epi8(0x0f)));
}

template <int K, int NV>
AVX2 void dot_iq4_xs_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    __m256 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(iq4_values)));
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 136;
        int s[8];
        iq4_xs_scales(b, s);
        __m256i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm256_setzero_si256();
        UNROLL for (int j = 0; j < 8; j++) {
            const __m256i q = lookup_32(b + 8 + 16 * j, table);
            const __m256i mag = _mm256_sign_epi8(q, q), scale = _mm256_set1_epi16(static_cast<int16_t>(s[j]));
            UNROLL for (int v = 0; v < NV; v++) {
                const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 32 * j));
                sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(y, q)), scale));
            }
        }
        const float d = f16c(b);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(a.d * d), _mm256_cvtepi32_ps(sumi[v]), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]);
}

// IQ4_NL and MXFP4: a block of 32 through its table, its integer dot product with x's block, times the
// scales (MXFP4's power of two first, on the exact integer sums, then x's d).
template <int K, int NV>
AVX2 void dot_nl_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = low_block_bytes(K);
    __m256 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i *>(K == l_iq4_nl ? iq4_values : mxfp4_values)));
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        const __m256i q = lookup_32(b + (K == l_iq4_nl ? 2 : 1), table);
        const __m256i mag = _mm256_sign_epi8(q, q);
        const float d = K == l_iq4_nl ? f16c(b) : e8m0_half(b[0]);
        UNROLL for (int v = 0; v < NV; v++) {
            const q8_32 & a = reinterpret_cast<const q8_32 *>(xq + v * xs)[i];
            const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs));
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(y, q)), ones));
            if constexpr (K == l_iq4_nl) acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), p, acc[v]);
            else acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(a.d), _mm256_mul_ps(_mm256_set1_ps(d), p), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]);
}
#endif

// ---------------------------------------------------------------------------------------------------
// the family's kernel sets (cpu/quants.h)

PEBBLE_DOT(low_portable, dot_low_portable)
#ifdef PEBBLE_X86
PEBBLE_DOT(k23_avx2, dot_k23_avx2)
PEBBLE_DOT(iq4_xs_avx2, dot_iq4_xs_avx2)
PEBBLE_DOT(nl_avx2, dot_nl_avx2)
#endif

} // namespace

kernel_set low_bit_kernels(int32_t type, simd level) {
#ifdef PEBBLE_X86
    if (level != simd::portable) {
        switch (type) {
            case 10: return set_of<k23_avx2, l_q2_k>(act::q8_256, 256, 84, 4);
            case 11: return set_of<k23_avx2, l_q3_k>(act::q8_256, 256, 110, 4);
            case 20: return set_of<nl_avx2, l_iq4_nl>(act::q8_32, 32, 18, 4);
            case 23: return set_of<iq4_xs_avx2, l_iq4_xs>(act::q8_256, 256, 136, 4);
            case 39: return set_of<nl_avx2, l_mxfp4>(act::q8_32, 32, 17, 4);
        }
    }
#endif
    (void)level;
    switch (type) {
        case 10: return set_of<low_portable, l_q2_k>(act::q8_256, 256, 84, 4);
        case 11: return set_of<low_portable, l_q3_k>(act::q8_256, 256, 110, 4);
        case 20: return set_of<low_portable, l_iq4_nl>(act::q8_32, 32, 18, 4);
        case 23: return set_of<low_portable, l_iq4_xs>(act::q8_256, 256, 136, 4);
        case 39: return set_of<low_portable, l_mxfp4>(act::q8_32, 32, 17, 4);
    }
    return {act::f32, 0, 0, 0, {}, {}};
}

} // namespace pebble_cpu

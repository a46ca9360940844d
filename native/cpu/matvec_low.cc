// cpu/matvec_low.cc: the CPU's row kernels for the 256-element types people pick to fit a model in less
// memory: Q2_K and Q3_K (2- and 3-bit quants under 4- and 6-bit scales a 16 elements) and IQ4_XS (eight
// 32-element sub-blocks of 4-bit indices into a table of sixteen non-uniform values, each under a 6-bit
// scale). One weight row times up to 4 activations quantized to 8-bit blocks of 256 with each 16's sum,
// each sub-block's integer dot product exact and its scale applied in integers, the block's in float once:
// portable C++ and AVX2 (vpmaddubsw / vpmaddwd). cpu/matmul.cc runs them over a matrix's rows. (The
// 32-element IQ4_NL and MXFP4 are cpu/matvec_32.cc's.) The values are gguf-py's dequantizers'; cuda/quants.cuh
// decodes them alike.

#include "cpu/quants.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pebble_cpu {
namespace {

enum low_kind { l_q2_k, l_q3_k, l_iq4_xs };

constexpr int low_block_bytes(int k) { return k == l_q2_k ? 84 : k == l_q3_k ? 110 : 136; }

// Q3_K's sixteen 6-bit scales (each 32 above its value), four a word: the low four bits of byte g % 8 (its
// high nibble for g >= 8) of the first eight bytes, the high two bits from byte 8 + g % 4, bits 2 (g / 4) up.
inline void q3_k_scale_words(const uint8_t * s, uint32_t v[4]) {
    uint32_t w[3];
    std::memcpy(w, s, 12);
    v[0] = (w[0] & 0x0f0f0f0f) | ((w[2] & 0x03030303) << 4);
    v[1] = (w[1] & 0x0f0f0f0f) | (((w[2] >> 2) & 0x03030303) << 4);
    v[2] = ((w[0] >> 4) & 0x0f0f0f0f) | (((w[2] >> 4) & 0x03030303) << 4);
    v[3] = ((w[1] >> 4) & 0x0f0f0f0f) | (((w[2] >> 6) & 0x03030303) << 4);
}

// IQ4_XS's sub-block j's 6-bit scale (32 above its value): nibble j of the 32-bit word at byte 4 below bits
// 2j, 2j + 1 of the 16-bit word at byte 2.
inline int iq4_xs_scale(uint32_t low, uint32_t high, int j) { return ((low >> (4 * j)) & 0xf) | (((high >> (2 * j)) & 3) << 4); }

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
        uint32_t words[4];
        q3_k_scale_words(b + 96, words);
        for (int g = 0; g < 16; g++) scale[g] = static_cast<int>((words[g / 4] >> (8 * (g % 4))) & 0xff) - 32, mn[g] = 0;
        for (int n = 0; n < 2; n++) {
            for (int j = 0; j < 4; j++) {
                for (int l = 0; l < 32; l++) {
                    const int low = (b[32 + 32 * n + l] >> (2 * j)) & 3, high = (b[l] >> (4 * n + j)) & 1;
                    q[128 * n + 32 * j + l] = static_cast<int8_t>(low - (high ? 0 : 4));
                }
            }
        }
    } else { // IQ4_XS: sub-block j's 16 bytes at 8 + 16j, elements l < 16 the low nibbles, 16 + l the high
        uint32_t low;
        std::memcpy(&low, b + 4, 4);
        for (int g = 0; g < 16; g++) scale[g] = iq4_xs_scale(low, u16(b + 2), g / 2) - 32, mn[g] = 0;
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
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

#ifdef PEBBLE_X86
// ---------------------------------------------------------------------------------------------------
// AVX2: 32 quants a register; vpmaddubsw's pairs cannot saturate (unsigned quants <= 7 against |x| <= 127;
// the tables' values go in as their magnitudes against x with their signs, |value| <= 127)

// Sixteen 16-bit scales (the 128-bit lanes holding 0..7 and 8..15) as two registers, each holding one lane's
// eight in both lanes, so that a pair of them is one vpshufb away (pair_of).
struct scale_halves { __m256i lo, hi; };

AVX2 inline scale_halves halves_of(__m256i scales16) {
    return {_mm256_permute2x128_si256(scales16, scales16, 0x00), _mm256_permute2x128_si256(scales16, scales16, 0x11)};
}

// 16-bit lanes 0..7 scale g, 8..15 scale g + 1 (g even): bytes 2g % 16 .. + 3 of the half that holds them.
AVX2 inline __m256i pair_of(const scale_halves & h, int g) {
    const int at = 2 * (g % 8);
    const __m256i index = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((at + 2) | (at + 3) << 8)),
                                           _mm_set1_epi16(static_cast<int16_t>(at | (at + 1) << 8)));
    return _mm256_shuffle_epi8(g < 8 ? h.lo : h.hi, index);
}

template <int K, int NV>
AVX2 void dot_k23_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    constexpr int bb = low_block_bytes(K);
    __m256 acc[NV];
    float macc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps(), macc[v] = 0.0f;
    const __m256i m2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        __m256i scales16, mins16 = _mm256_setzero_si256(), hm = _mm256_setzero_si256();
        float d, dmin = 0.0f;
        if constexpr (K == l_q2_k) { // a byte per 16: the scale its low nibble, the min its high one
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b));
            scales16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f)));
            mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f)));
            d = f16c(b + 80), dmin = f16c(b + 82);
        } else {
            uint32_t v[4];
            q3_k_scale_words(b + 96, v);
            const __m128i s = _mm_sub_epi8(_mm_set_epi32(static_cast<int>(v[3]), static_cast<int>(v[2]), static_cast<int>(v[1]),
                                                         static_cast<int>(v[0])), _mm_set1_epi8(32));
            scales16 = _mm256_cvtepi8_epi16(s);
            hm = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b));
            d = f16c(b + 108);
        }
        const scale_halves halves = halves_of(scales16);
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
                __m256i q = _mm256_and_si256(j ? _mm256_srli_epi16(raw, 2 * j) : raw, m2);
                if constexpr (K == l_q3_k) { // bit 4n + j of each byte of hm, as bit 2
                    const int k = 4 * n + j;
                    const __m256i h = k < 2 ? _mm256_slli_epi16(hm, 2 - k) : k > 2 ? _mm256_srli_epi16(hm, k - 2) : hm;
                    q = _mm256_or_si256(q, _mm256_and_si256(h, bit2));
                }
                const __m256i s = pair_of(halves, 8 * n + 2 * j);
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

// IQ4_XS: a sub-block's 16 bytes, low nibbles then high ones, are its 32 indices in element order; each
// through the table, its magnitude against x with its sign (|value| <= 127: vpmaddubsw's pairs cannot
// saturate), times the sub-block's scale.
template <int K, int NV>
AVX2 void dot_iq4_xs_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    __m256 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(iq4_values)));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i nibble_at = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), pair_at = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * 136;
        uint32_t low;
        std::memcpy(&low, b + 4, 4);
        // the eight scales less 32, as 16-bit words in both lanes
        const __m256i s32 = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(low)), nibble_at), _mm256_set1_epi32(0xf)),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(u16(b + 2)), pair_at), _mm256_set1_epi32(3)), 4)),
            _mm256_set1_epi32(32));
        const __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        const __m256i scales = _mm256_broadcastsi128_si256(s16);
        __m256i sumi[NV];
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = _mm256_setzero_si256();
        UNROLL for (int c = 0; c < 4; c++) { // sub-blocks 2c and 2c + 1: 32 bytes
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 8 + 32 * c));
            const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            const __m256i q[2] = {_mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20)),
                                  _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31))};
            UNROLL for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                const __m256i mag = _mm256_sign_epi8(q[h], q[h]);
                const __m256i scale = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(2 * j | (2 * j + 1) << 8)));
                UNROLL for (int v = 0; v < NV; v++) {
                    const q8_256 & a = reinterpret_cast<const q8_256 *>(xq + v * xs)[i];
                    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs + 32 * j));
                    sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(y, q[h])), scale));
                }
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
#endif

// ---------------------------------------------------------------------------------------------------
// the family's kernel sets (cpu/quants.h)

PEBBLE_DOT(low_portable, dot_low_portable)
#ifdef PEBBLE_X86
PEBBLE_DOT(k23_avx2, dot_k23_avx2)
PEBBLE_DOT(iq4_xs_avx2, dot_iq4_xs_avx2)
#endif

} // namespace

kernel_set low_bit_kernels(int32_t type, simd level) {
#ifdef PEBBLE_X86
    if (level != simd::portable) {
        switch (type) {
            case 10: return set_of<k23_avx2, l_q2_k>(act::q8_256, 256, 84, 4);
            case 11: return set_of<k23_avx2, l_q3_k>(act::q8_256, 256, 110, 4);
            case 23: return set_of<iq4_xs_avx2, l_iq4_xs>(act::q8_256, 256, 136, 4);
        }
    }
#endif
    (void)level;
    switch (type) {
        case 10: return set_of<low_portable, l_q2_k>(act::q8_256, 256, 84, 4);
        case 11: return set_of<low_portable, l_q3_k>(act::q8_256, 256, 110, 4);
        case 23: return set_of<low_portable, l_iq4_xs>(act::q8_256, 256, 136, 4);
    }
    return {act::f32, 0, 0, 0, {}, {}};
}

} // namespace pebble_cpu

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
                q[32 * j + l] = iq4_values.v[b[8 + 16 * j + l] & 0xf];
                q[32 * j + 16 + l] = iq4_values.v[b[8 + 16 * j + l] >> 4];
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

// Block i of a row (b) times NV activations, as integers: the lanes of sumi[v] add up to the block's
// sum over its sub-blocks of scale * (its quants times x's q), offsets included; those of summ[v] (Q2_K) to
// sum_g min_g * x's sum over g. d and dmin: its scales.
template <int K, int NV>
AVX2 __attribute__((always_inline)) inline void low_block_ints(const uint8_t * b, const uint8_t * xq, int64_t xs, int64_t i,
                                                               __m256i * sumi, __m256i * summ, float & d, float & dmin) {
    const q8_256 * x[NV];
    UNROLL for (int v = 0; v < NV; v++) x[v] = reinterpret_cast<const q8_256 *>(xq + v * xs) + i;
    if constexpr (K == l_iq4_xs) {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(iq4_values.v)));
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        uint32_t low;
        std::memcpy(&low, b + 4, 4);
        // the eight scales less 32, as 16-bit words in both lanes
        const __m256i s32 = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(low)),
                                                               _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(0xf)),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(u16(b + 2)),
                                                                                 _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                                               _mm256_set1_epi32(3)), 4)),
            _mm256_set1_epi32(32));
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1)));
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
                    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[v]->qs + 32 * j));
                    sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(y, q[h])), scale));
                }
            }
        }
        d = f16c(b);
        return;
    } else {
        const __m256i m2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
        __m256i scales16, hm = _mm256_setzero_si256();
        if constexpr (K == l_q2_k) { // a byte per 16: the scale its low nibble, the min its high one
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b));
            scales16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f)));
            const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f)));
            UNROLL for (int v = 0; v < NV; v++) {
                summ[v] = _mm256_madd_epi16(mins16, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[v]->sums)));
                sumi[v] = _mm256_setzero_si256();
            }
            d = f16c(b + 80), dmin = f16c(b + 82);
        } else {
            uint32_t w[4];
            q3_k_scale_words(b + 96, w);
            const __m128i s = _mm_sub_epi8(_mm_set_epi32(static_cast<int>(w[3]), static_cast<int>(w[2]), static_cast<int>(w[1]),
                                                         static_cast<int>(w[0])), _mm_set1_epi8(32));
            scales16 = _mm256_cvtepi8_epi16(s);
            hm = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b));
            UNROLL for (int v = 0; v < NV; v++) { // the quants go in as 0..7, 4 above their values: -4 sum_g scale_g x's sum_g
                const __m256i corr = _mm256_madd_epi16(scales16, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[v]->sums)));
                sumi[v] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 2));
            }
            d = f16c(b + 108);
        }
        const scale_halves halves = halves_of(scales16);
        const uint8_t * qs = b + (K == l_q2_k ? 16 : 32);
        UNROLL for (int n = 0; n < 2; n++) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * n));
            UNROLL for (int j = 0; j < 4; j++) { // elements 128n + 32j .. + 31: sub-blocks 8n + 2j, 8n + 2j + 1
                __m256i q = _mm256_and_si256(j ? _mm256_srli_epi16(raw, 2 * j) : raw, m2);
                if constexpr (K == l_q3_k) { // bit 4n + j of each byte of hm, as bit 2
                    const int k = 4 * n + j;
                    const __m256i h = k < 2 ? _mm256_slli_epi16(hm, 2 - k) : k > 2 ? _mm256_srli_epi16(hm, k - 2) : hm;
                    q = _mm256_or_si256(q, _mm256_and_si256(h, bit2));
                }
                const __m256i scale = pair_of(halves, 8 * n + 2 * j);
                UNROLL for (int v = 0; v < NV; v++) {
                    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[v]->qs + 128 * n + 32 * j));
                    sumi[v] = _mm256_add_epi32(sumi[v], _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), scale));
                }
            }
        }
    }
}

// The row kernel: each block's integers times d and x's d into a float vector a vector, the mins apart.
template <int K, int NV>
AVX2 void dot_low_avx2(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    __m256 acc[NV];
    float macc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps(), macc[v] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        __m256i sumi[NV], summ[NV];
        float d, dmin = 0.0f;
        low_block_ints<K, NV>(w + i * low_block_bytes(K), xq, xs, i, sumi, summ, d, dmin);
        UNROLL for (int v = 0; v < NV; v++) {
            const float xd = reinterpret_cast<const q8_256 *>(xq + v * xs)[i].d;
            acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(xd * d), _mm256_cvtepi32_ps(sumi[v]), acc[v]);
            if constexpr (K == l_q2_k) macc[v] += xd * dmin * static_cast<float>(hsum_epi32(summ[v]));
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = hsum_ps(acc[v]) - macc[v];
}

// ---------------------------------------------------------------------------------------------------
// AVX-512 VNNI: sixteen rows at a time (see "Sixteen rows at a time" in cpu/quants.h), each lane a row: a
// sub-block's quants of sixteen rows transposed into registers, x's quants four a dword broadcast to them
// (vpdpbusd), a 16-element sum times each lane's scale. Then per block and row the same two fused
// multiply-adds as dot_low_exact makes, so that a row's bits do not depend on the kernel that took it.

// Rows 0..15 of a group: lane r = r * rb, for the gathers of a block's scale fields.
AVX512 inline __m512i row_offsets(int64_t rb) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32(static_cast<int32_t>(rb)));
}

// sumi + p * scale, p and scale each a 32-bit lane: vpdpwssd on p's low 16 bits where |p| < 2^15 (Q2_K's
// and Q3_K's 16-element sums: at most 16 * 7 * 127 + 4 * 16 * 127) and scale's high 16 bits are zero.
AVX512 inline __m512i add_scaled16(__m512i sumi, __m512i p, __m512i scale) {
    return _mm512_dpwssd_epi32(sumi, p, _mm512_and_si512(scale, _mm512_set1_epi32(0xffff)));
}

// IQ4_XS for sixteen rows: a block's head (d, and the scales' fields as lanes), and sub-block j's quants as
// each value + 128 in q[0..3] (elements 0..15, four a lane's dword) and q[4..7] (16..31), with its scale; then
// one vector's sum of the sub-block, x's 128 times its sum taken away (vpdpbusd multiplies unsigned bytes).
struct iq4_xs_head { __m512 d; __m512i low, high, table; };

AVX512 __attribute__((always_inline)) inline iq4_xs_head iq4_xs_head_of(const uint8_t * b, __m512i rows) {
    const __m512i head = _mm512_i32gather_epi32(rows, b, 1);
    return {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)), _mm512_i32gather_epi32(rows, b + 4, 1), _mm512_srli_epi32(head, 16),
            _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i *>(iq4_values.v))),
                             _mm512_set1_epi8(static_cast<char>(0x80)))};
}

AVX512 __attribute__((always_inline)) inline __m512i iq4_xs_sub_block(const uint8_t * b, int64_t rb, const iq4_xs_head & h, int j,
                                                                      __m512i q[8]) {
    const __m512i low4 = _mm512_set1_epi32(0x0f0f0f0f);
    __m512i t[4];
    load_16x4(b + 8 + 16 * j, rb, t);
    UNROLL for (int m = 0; m < 4; m++) {
        q[m] = _mm512_shuffle_epi8(h.table, _mm512_and_si512(t[m], low4));
        q[4 + m] = _mm512_shuffle_epi8(h.table, _mm512_and_si512(_mm512_srli_epi32(t[m], 4), low4));
    }
    return _mm512_sub_epi32(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h.low, 4 * j), _mm512_set1_epi32(0xf)),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h.high, 2 * j), _mm512_set1_epi32(3)), 4)),
                            _mm512_set1_epi32(32));
}

AVX512 __attribute__((always_inline)) inline __m512i iq4_xs_add_sub_block(__m512i sumi, const __m512i q[8], __m512i scale,
                                                                          const q8_256 * x, int j) {
    const int8_t * xq = x->qs + 32 * j;
    __m512i p = _mm512_set1_epi32(-128 * (x->sums[2 * j] + x->sums[2 * j + 1]));
    UNROLL for (int m = 0; m < 4; m++) {
        p = _mm512_dpbusd_epi32(p, q[m], _mm512_set1_epi32(dword_at(xq + 4 * m)));
        p = _mm512_dpbusd_epi32(p, q[4 + m], _mm512_set1_epi32(dword_at(xq + 16 + 4 * m)));
    }
    return _mm512_add_epi32(sumi, _mm512_mullo_epi32(p, scale));
}

// IQ4_XS's sixteen rows times any number of vectors (a prompt's): each block decoded once, onto the stack,
// for 64 of them rather than once per 16 (the decoding took a quarter of a 16-vector pass), then 16 vectors
// at a time (their sums in registers, a sub-block's quants loaded once for them) through its eight
// sub-blocks, each vector's float sum in a stack array (in y itself, whose rows lie a matrix's width apart,
// 16 of them fell in one set of the first-level cache), written to y at the end: the same integers per block
// and the same fused multiply-add after them as rows16_low, so the same bits. 8192 x 3072 x 128 on 2 cores
// (AMD EPYC, the least of several runs): 9.7 ms, rows16_low 13.4. (x's sum taken away as a 16-bit pair
// product, vpdpwssd, instead of a broadcast per vector: slower, another multiply on the busiest unit.)
//
// Block i of sixteen IQ4_XS rows decoded (prompt_frame's decode), and V vectors through it.
struct iq4_xs_block {
    __m512i q[8][8], scale[8];
    __m512  d;
    template <int V> AVX512 void times(const uint8_t * xq, int64_t xs, int64_t i, float * acc) const;
};

template <int V>
AVX512 void iq4_xs_block::times(const uint8_t * xq, int64_t xs, int64_t i, float * acc) const {
    const q8_256 * x[V];
    __m512i sumi[V];
    UNROLL for (int v = 0; v < V; v++) x[v] = reinterpret_cast<const q8_256 *>(xq + v * xs) + i, sumi[v] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int j = 0; j < 8; j++) {
        __m512i w[8];
        UNROLL for (int m = 0; m < 8; m++) w[m] = q[j][m];
        const __m512i sc = scale[j];
        UNROLL for (int v = 0; v < V; v++) sumi[v] = iq4_xs_add_sub_block(sumi[v], w, sc, x[v], j);
    }
    UNROLL for (int v = 0; v < V; v++) {
        const __m512 a = _mm512_load_ps(acc + 16 * v);
        _mm512_store_ps(acc + 16 * v, _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[v]->d)), _mm512_cvtepi32_ps(sumi[v]), a));
    }
}

struct iq4_xs_decode {
    const uint8_t * w;
    int64_t         rb;
    AVX512 iq4_xs_block operator()(int64_t i) const {
        constexpr int bb = low_block_bytes(l_iq4_xs);
        const uint8_t * b = w + i * bb;
        prefetch_next_group(w, rb, i, bb);
        const iq4_xs_head head = iq4_xs_head_of(b, row_offsets(rb));
        iq4_xs_block blk;
        blk.d = head.d;
        UNROLL for (int j = 0; j < 8; j++) blk.scale[j] = iq4_xs_sub_block(b, rb, head, j, blk.q[j]);
        return blk;
    }
};

AVX512 void iq4_xs_many(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, int64_t n, float * y, int64_t ys) {
    prompt_frame(iq4_xs_decode{w, rb}, nb, xq, xs, n, y, ys);
}

template <int K, int NV>
AVX512 void rows16_low(const uint8_t * w, int64_t rb, int64_t nb, const uint8_t * xq, int64_t xs, float * y, int64_t ys) {
    constexpr int bb = low_block_bytes(K);
    const __m512i rows = row_offsets(rb), low4 = _mm512_set1_epi32(0x0f0f0f0f), low2 = _mm512_set1_epi32(0x03030303);
    // the sums: in registers up to 8 vectors; past that in y itself (the same operations, so the same bits),
    // where the registers are the sub-blocks' and the integer sums'
    constexpr bool in_y = NV > 8;
    __m512 acc[in_y ? 1 : NV];
    UNROLL for (int v = 0; v < NV; v++) {
        if constexpr (in_y) _mm512_storeu_ps(y + v * ys, _mm512_setzero_ps());
        else acc[v] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * b = w + i * bb;
        prefetch_next_group(w, rb, i, bb);
        const q8_256 * x[NV];
        UNROLL for (int v = 0; v < NV; v++) x[v] = reinterpret_cast<const q8_256 *>(xq + v * xs) + i;
        __m512i sumi[NV], summ[NV];
        __m512 d, dmin = _mm512_setzero_ps();
        UNROLL for (int v = 0; v < NV; v++) sumi[v] = summ[v] = _mm512_setzero_si512();
        if constexpr (K == l_iq4_xs) {
            const iq4_xs_head head = iq4_xs_head_of(b, rows);
            d = head.d;
            UNROLL for (int j = 0; j < 8; j++) {
                __m512i q[8];
                const __m512i scale = iq4_xs_sub_block(b, rb, head, j, q);
                UNROLL for (int v = 0; v < NV; v++) sumi[v] = iq4_xs_add_sub_block(sumi[v], q, scale, x[v], j);
            }
        } else {
            __m512i sc[4]; // a lane's scale of sub-block g: byte g % 4 of sc[g / 4]
            __m512i hm[2][4];
            if constexpr (K == l_q2_k) {
                const __m512i head = _mm512_i32gather_epi32(rows, b + 80, 1);
                d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
                dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
                __m512i raw[4];
                load_16x4(b, rb, raw);
                UNROLL for (int m = 0; m < 4; m++) {
                    sc[m] = _mm512_and_si512(raw[m], low4);
                    // the mins of sub-blocks 4m + 2h and 4m + 2h + 1 as the 16-bit halves of a lane, beside x's two sums
                    const __m512i pair[2] = {
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(raw[m], 4), _mm512_set1_epi32(0xf)),
                                        _mm512_and_si512(_mm512_slli_epi32(raw[m], 4), _mm512_set1_epi32(0xf0000))),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(raw[m], 20), _mm512_set1_epi32(0xf)),
                                        _mm512_and_si512(_mm512_srli_epi32(raw[m], 12), _mm512_set1_epi32(0xf0000)))};
                    UNROLL for (int h = 0; h < 2; h++) {
                        UNROLL for (int v = 0; v < NV; v++) {
                            summ[v] = _mm512_dpwssd_epi32(summ[v], pair[h], _mm512_set1_epi32(dword_at(
                                reinterpret_cast<const int8_t *>(x[v]->sums + 4 * m + 2 * h))));
                        }
                    }
                }
            } else { // bytes 94..109: the twelve bytes of scales two bytes in, then d
                __m512i t[4];
                load_16x4(b + 94, rb, t);
                d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t[3], 16)));
                __m512i words[3];
                UNROLL for (int m = 0; m < 3; m++) words[m] = _mm512_or_si512(_mm512_srli_epi32(t[m], 16), _mm512_slli_epi32(t[m + 1], 16));
                sc[0] = _mm512_or_si512(_mm512_and_si512(words[0], low4), _mm512_slli_epi32(_mm512_and_si512(words[2], low2), 4));
                sc[1] = _mm512_or_si512(_mm512_and_si512(words[1], low4),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(words[2], 2), low2), 4));
                sc[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(words[0], 4), low4),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(words[2], 4), low2), 4));
                sc[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(words[1], 4), low4),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(words[2], 6), low2), 4));
                load_16x4(b, rb, hm[0]);
                load_16x4(b + 16, rb, hm[1]);
            }
            UNROLL for (int n = 0; n < 2; n++) {
                UNROLL for (int h = 0; h < 2; h++) { // elements 128n + 32j + 16h .. + 15, j = 0..3
                    __m512i t[4];
                    load_16x4(b + (K == l_q2_k ? 16 : 32) + 32 * n + 16 * h, rb, t);
                    UNROLL for (int j = 0; j < 4; j++) {
                        const int g = 8 * n + 2 * j + h;
                        __m512i scale = _mm512_and_si512(_mm512_srli_epi32(sc[g / 4], 8 * (g % 4)), _mm512_set1_epi32(0xff));
                        if constexpr (K == l_q3_k) scale = _mm512_sub_epi32(scale, _mm512_set1_epi32(32));
                        __m512i q[4];
                        UNROLL for (int m = 0; m < 4; m++) {
                            q[m] = _mm512_and_si512(_mm512_srli_epi32(t[m], 2 * j), low2);
                            if constexpr (K == l_q3_k) { // bit 4n + j of the high-bit bytes, as bit 2
                                const int k = 4 * n + j;
                                const __m512i hb = k < 2 ? _mm512_slli_epi32(hm[h][m], 2 - k) : _mm512_srli_epi32(hm[h][m], k - 2);
                                q[m] = _mm512_or_si512(q[m], _mm512_and_si512(hb, _mm512_set1_epi8(4)));
                            }
                        }
                        UNROLL for (int v = 0; v < NV; v++) {
                            const int8_t * xg = x[v]->qs + 16 * g;
                            __m512i p = K == l_q3_k ? _mm512_set1_epi32(-4 * x[v]->sums[g]) : _mm512_setzero_si512();
                            UNROLL for (int m = 0; m < 4; m++) p = _mm512_dpbusd_epi32(p, q[m], _mm512_set1_epi32(dword_at(xg + 4 * m)));
                            sumi[v] = add_scaled16(sumi[v], p, scale);
                        }
                    }
                }
            }
        }
        UNROLL for (int v = 0; v < NV; v++) {
            const __m512 xd = _mm512_set1_ps(x[v]->d);
            __m512 a = in_y ? _mm512_loadu_ps(y + v * ys) : acc[in_y ? 0 : v];
            a = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(sumi[v]), a);
            if constexpr (K == l_q2_k) a = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, xd), _mm512_cvtepi32_ps(summ[v]), a);
            if constexpr (in_y) _mm512_storeu_ps(y + v * ys, a);
            else acc[in_y ? 0 : v] = a;
        }
    }
    if constexpr (!in_y) {
        UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + v * ys, acc[v]);
    }
}

// A matrix's last rows (past its whole groups of 16), and one vector: low_block_ints' integers, then per
// block rows16_low's two fused multiply-adds.
template <int K, int NV>
AVX512 void dot_low_exact(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        __m256i sumi[NV], summ[NV];
        float d, dmin = 0.0f;
        low_block_ints<K, NV>(w + i * low_block_bytes(K), xq, xs, i, sumi, summ, d, dmin);
        UNROLL for (int v = 0; v < NV; v++) {
            const float xd = reinterpret_cast<const q8_256 *>(xq + v * xs)[i].d;
            acc[v] = std::fma(d * xd, static_cast<float>(hsum_epi32(sumi[v])), acc[v]);
            if constexpr (K == l_q2_k) acc[v] = std::fma(-(dmin * xd), static_cast<float>(hsum_epi32(summ[v])), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) out[v] = acc[v];
}
#endif

// ---------------------------------------------------------------------------------------------------
// the family's kernel sets (cpu/quants.h)

PEBBLE_DOT(low_portable, dot_low_portable)
#ifdef PEBBLE_X86
PEBBLE_DOT(low_avx2, dot_low_avx2)
PEBBLE_DOT(low_exact, dot_low_exact)
template <int K> struct low_rows { template <int NV> struct at { static constexpr rows_fn fn = rows16_low<K, NV>; }; };
#endif

} // namespace

kernel_set low_bit_kernels(int32_t type, simd level) {
#ifdef PEBBLE_X86
    if (level == simd::avx512) {
        switch (type) {
            case 10: return with_rows<low_rows<l_q2_k>::template at>(set_of<low_exact, l_q2_k>(act::q8_256, 256, 84, 8), upto<8>{});
            case 11: return with_rows<low_rows<l_q3_k>::template at>(set_of<low_exact, l_q3_k>(act::q8_256, 256, 110, 8), upto<8>{});
            case 23: {
                kernel_set k = with_rows<low_rows<l_iq4_xs>::template at>(set_of<low_exact, l_iq4_xs>(act::q8_256, 256, 136, 16), upto<16>{});
                k.many = iq4_xs_many;
                return k;
            }
        }
    }
    if (level != simd::portable) {
        switch (type) {
            case 10: return set_of<low_avx2, l_q2_k>(act::q8_256, 256, 84, 4);
            case 11: return set_of<low_avx2, l_q3_k>(act::q8_256, 256, 110, 4);
            case 23: return set_of<low_avx2, l_iq4_xs>(act::q8_256, 256, 136, 4);
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

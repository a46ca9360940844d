// cpu/quants.h: the quantized types as the host library's CPU kernels meet them: each weight type's block
// layout and decoders (the 32-element Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the 256-element Q4_K, Q5_K,
// Q6_K), x's layouts once quantized to 8-bit blocks (q8_32, q8_256, and AVX-512's q8_k512), the loads of
// sixteen rows at a time that the AVX-512 kernels share, and the table of kernels a type has
// (kernel_set): cpu/matmul.cc looks it up, each family's source fills its part (cpu/matvec_32.cc,
// cpu/matvec_k.cc, cpu/matvec_float.cc), and cpu/quantize.cc lays x out for it. Not part of the ABI.
#pragma once

#include "cpu/simd.h"
#include "pebble.h"

#include <cstdint>
#include <cstring>
#include <utility>

namespace pebble_cpu {

// ---------------------------------------------------------------------------------------------------
// activations: x quantized to 8-bit blocks, once per call

// For the K-quants: 256 elements, d = max|x| / 127, q = round(x / d), and the sum of each 16 q.
struct q8_256 {
    float   d;
    int16_t sums[16];
    int8_t  qs[256];
};

// For the 32-element types: the same per 32 elements, with the sum of all 32.
struct q8_32 {
    float   d;
    int32_t sum;
    int8_t  qs[32];
};

#ifdef PEBBLE_X86
// One 256-element block of x for the K-quants: its q in the order the weight type's registers hold
// its quants (see quantize_k512), the sum of each 16 in natural order, and d.
struct alignas(64) q8_k512 {
    int8_t  qs[256];
    int16_t sums[16];
    float   d;
};
#endif

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j (GGML's layout; see type_q4_k in cuda/quants.cuh).
inline void scale_min_k4(const uint8_t * s, int j, int & scale, int & min) {
    if (j < 4) {
        scale = s[j] & 63;
        min   = s[j + 4] & 63;
    } else {
        scale = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        min   = (s[j + 4] >> 4)  | ((s[j] >> 6) << 4);
    }
}

// ---------------------------------------------------------------------------------------------------
// row kernels: one weight row (nb blocks) times NV activations, each xs bytes after the last.
// out[v] = the dot product with activation v. Portable versions first: each block is decoded once to
// integers and multiplied by every activation.

enum kind { k_q4_0, k_q4_1, k_q5_0, k_q5_1, k_q8_0, k_q4_k, k_q5_k, k_q6_k, k_f32, k_f16, k_bf16, k_iq4_nl, k_mxfp4 };

// IQ4_NL's (and IQ4_XS's) sixteen values and MXFP4's doubled e2m1 values, as arrays for vpshufb and the
// portable decoders: the bytes of pebble_device.h's constants, which the GPU's decoders read.
struct table16 { alignas(16) int8_t v[16]; };
constexpr table16 table_bytes(uint64_t lo, uint64_t hi) {
    table16 t{};
    for (int i = 0; i < 8; i++) {
        t.v[i] = static_cast<int8_t>((lo >> (8 * i)) & 0xff);
        t.v[8 + i] = static_cast<int8_t>((hi >> (8 * i)) & 0xff);
    }
    return t;
}
inline constexpr table16 iq4_values = table_bytes(pebble_internal::iq4_values_lo, pebble_internal::iq4_values_hi);
inline constexpr table16 mxfp4_values = table_bytes(pebble_internal::mxfp4_values_lo, pebble_internal::mxfp4_values_hi);
using pebble_internal::e8m0_half;

// A 32-element type's scale: its fp16 d (the first two bytes), or MXFP4's power of two (its first byte).
template <int K> inline float scale_32(const uint8_t * b) { return K == k_mxfp4 ? e8m0_half(b[0]) : f16(b); }

// A 32-element block as integers q and how its value follows: d * (q - offset) (+ m).
template <int K>
void decode_32(const uint8_t * b, int * q, float & d, float & m) {
    m = 0.0f;
    if constexpr (K == k_iq4_nl || K == k_mxfp4) { // 16 bytes of indices into the table, laid out as Q4_0's nibbles
        d = scale_32<K>(b);
        const int8_t * table = K == k_iq4_nl ? iq4_values.v : mxfp4_values.v;
        const uint8_t * qs = b + (K == k_iq4_nl ? 2 : 1);
        for (int i = 0; i < 16; i++) q[i] = table[qs[i] & 0xf], q[i + 16] = table[qs[i] >> 4];
    } else if constexpr (K == k_q8_0) {
        d = f16(b);
        for (int i = 0; i < 32; i++) q[i] = static_cast<int8_t>(b[2 + i]);
    } else if constexpr (K == k_q4_0 || K == k_q4_1) {
        d = f16(b);
        const uint8_t * qs = b + (K == k_q4_0 ? 2 : 4);
        if (K == k_q4_1) m = f16(b + 2);
        for (int i = 0; i < 16; i++) {
            q[i] = (qs[i] & 0xf) - (K == k_q4_0 ? 8 : 0);
            q[i + 16] = (qs[i] >> 4) - (K == k_q4_0 ? 8 : 0);
        }
    } else {
        d = f16(b);
        const int o = K == k_q5_0 ? 2 : 4;
        if (K == k_q5_1) m = f16(b + 2);
        const uint32_t qh = b[o] | b[o + 1] << 8 | b[o + 2] << 16 | static_cast<uint32_t>(b[o + 3]) << 24;
        const uint8_t * qs = b + o + 4;
        for (int i = 0; i < 16; i++) {
            q[i] = static_cast<int>((qs[i] & 0xf) | ((qh >> i) & 1) << 4) - (K == k_q5_0 ? 16 : 0);
            q[i + 16] = static_cast<int>((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - (K == k_q5_0 ? 16 : 0);
        }
    }
}

constexpr int block_bytes_32(int k) {
    return k == k_q4_0 || k == k_iq4_nl ? 18 : k == k_mxfp4 ? 17 : k == k_q4_1 ? 20 : k == k_q5_0 ? 22 : k == k_q5_1 ? 24 : 34;
}

// Where a 32-element type's quants start in its block.
constexpr int quants_at_32(int k) {
    return k == k_mxfp4 ? 1 : k == k_q4_0 || k == k_q8_0 || k == k_iq4_nl ? 2 : k == k_q4_1 ? 4 : k == k_q5_0 ? 6 : 8;
}

#ifdef PEBBLE_X86
// 32 bits into 32 bytes, byte i = 0x10 where bit i is set.
AVX2 inline __m256i bits_to_0x10(uint32_t bits) {
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
    const __m256i mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    v = _mm256_or_si256(v, mask);
    v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// A 32-element block's quants as 32 signed bytes (Q4_0, Q5_0, Q8_0, and IQ4_NL's and MXFP4's values) or
// unsigned ones (Q4_1, Q5_1).
template <int K>
AVX2 inline __m256i decode_32_avx2(const uint8_t * b) {
    if constexpr (K == k_q8_0) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2));
    } else {
        constexpr int o = quants_at_32(K);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + o));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        __m256i q = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
        if constexpr (K == k_q5_0 || K == k_q5_1) {
            uint32_t qh;
            std::memcpy(&qh, b + o - 4, 4);
            q = _mm256_or_si256(q, bits_to_0x10(qh));
        }
        if constexpr (K == k_iq4_nl || K == k_mxfp4) {
            const __m128i values = _mm_load_si128(reinterpret_cast<const __m128i *>(K == k_iq4_nl ? iq4_values.v : mxfp4_values.v));
            q = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(values), q);
        }
        if constexpr (K == k_q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        if constexpr (K == k_q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        return q;
    }
}

// Q4_K's and Q5_K's twelve bytes of scales and mins as eight scales (bytes 0..7 of out) and eight
// mins (bytes 8..15), with word operations rather than eight branches (the layout of scale_min_k4).
inline void unpack_scales_k4(const uint8_t * s, uint32_t out[4]) {
    uint32_t w[3];
    std::memcpy(w, s, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    out[0] = w[0] & low6;                                            // scales 0..3
    out[1] = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);            // scales 4..7
    out[2] = w[1] & low6;                                            // mins 0..3
    out[3] = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);     // mins 4..7
}

// ---------------------------------------------------------------------------------------------------
// Sixteen rows at a time (AVX-512): a register's sixteen 32-bit lanes are sixteen weight rows, so that a
// block's scales multiply sixteen rows' integer sums in one operation, and x's four quants a dword are
// broadcast to every lane. A row kernel reduces its row across lanes instead, then pays its float
// epilogue per block and row: with 8 activations it took most of their time (Q4_K 512 x 1024 x 8 on one
// core: 123 GOP/s row by row, 211 sixteen rows at a time). A group's blocks are transposed on the way in
// (16 bytes of each of 16 rows: four 4 x 4 transposes of dwords); out[v * ys + r] for rows r < 16.

// t[m] lane r = dword m of the 16 bytes at p + r * rb.
AVX512 __attribute__((always_inline)) inline void load_16x4(const uint8_t * p, int64_t rb, __m512i t[4]) {
    __m512i u[4];
    UNROLL for (int i = 0; i < 4; i++) { // u[i]'s 128-bit lane q: row 4q + i
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + i * rb)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + (4 + i) * rb)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + (8 + i) * rb)), 2);
        u[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + (12 + i) * rb)), 3);
    }
    const __m512i a = _mm512_unpacklo_epi32(u[0], u[1]), b = _mm512_unpackhi_epi32(u[0], u[1]);
    const __m512i c = _mm512_unpacklo_epi32(u[2], u[3]), d = _mm512_unpackhi_epi32(u[2], u[3]);
    t[0] = _mm512_unpacklo_epi64(a, c);
    t[1] = _mm512_unpackhi_epi64(a, c);
    t[2] = _mm512_unpacklo_epi64(b, d);
    t[3] = _mm512_unpackhi_epi64(b, d);
}

// A group's 16 rows are 16 * rb bytes in a row of memory, read a block column at a time: sixteen streams,
// more than the hardware's prefetchers follow. While a group reads its block i, the bytes two groups on
// are asked for in order, 16 blocks' worth, into the second-level cache only (prefetcht2: AMD's L2), so
// that a group's rows are there when it starts. Fetched into the first-level cache instead (prefetcht0),
// Qwen2.5-1.5B's 8960 x 1536 Q4_K matrices read half as fast; with no prefetch at all, a third as fast.
constexpr int64_t groups_ahead = 2;

inline void prefetch_group_bytes(const uint8_t * p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 1);
}

inline void prefetch_next_group(const uint8_t * w, int64_t rb, int64_t i, int64_t bb) {
    prefetch_group_bytes(w + 16 * rb * groups_ahead + i * 16 * bb, 16 * bb);
}

// The frame of a prompt's kernel (kernel_set::many), whatever its type: the vectors prompt_vectors at a time
// (enough that a block decoded once serves most of a prompt, few enough that their blocks of x stay in the
// second-level cache), each vector's float sums of the sixteen rows in a stack array (in y itself, whose rows
// lie a matrix's width apart, 16 of them fell in one set of the first-level cache), then written to y.
// decode(i) returns block i of the group decoded; its member times<V>(x, xs, i, acc) takes V vectors.
constexpr int64_t prompt_vectors = 64;

template <class Decode>
AVX512 void prompt_frame(const Decode & decode, int64_t nb, const uint8_t * xq, int64_t xs, int64_t n, float * y, int64_t ys) {
    alignas(64) float acc[prompt_vectors * 16];
    for (int64_t t0 = 0; t0 < n; t0 += prompt_vectors) {
        const int64_t m = n - t0 < prompt_vectors ? n - t0 : prompt_vectors;
        const uint8_t * x0 = xq + t0 * xs;
        for (int64_t v = 0; v < m; v++) _mm512_store_ps(acc + 16 * v, _mm512_setzero_ps());
        for (int64_t i = 0; i < nb; i++) {
            const auto block = decode(i);
            int64_t t = 0; // 16 vectors at a time, then 8, then the rest
            for (; t + 16 <= m; t += 16) block.template times<16>(x0 + t * xs, xs, i, acc + 16 * t);
            if (t + 8 <= m) block.template times<8>(x0 + t * xs, xs, i, acc + 16 * t), t += 8;
            switch (m - t) {
                case 1: block.template times<1>(x0 + t * xs, xs, i, acc + 16 * t); break;
                case 2: block.template times<2>(x0 + t * xs, xs, i, acc + 16 * t); break;
                case 3: block.template times<3>(x0 + t * xs, xs, i, acc + 16 * t); break;
                case 4: block.template times<4>(x0 + t * xs, xs, i, acc + 16 * t); break;
                case 5: block.template times<5>(x0 + t * xs, xs, i, acc + 16 * t); break;
                case 6: block.template times<6>(x0 + t * xs, xs, i, acc + 16 * t); break;
                case 7: block.template times<7>(x0 + t * xs, xs, i, acc + 16 * t); break;
            }
        }
        for (int64_t v = 0; v < m; v++) _mm512_storeu_ps(y + (t0 + v) * ys, _mm512_load_ps(acc + 16 * v));
    }
}

inline int32_t dword_at(const int8_t * p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}
#endif

// ---------------------------------------------------------------------------------------------------
// dispatch

using dot_fn = void (*)(const uint8_t *, int64_t, const uint8_t *, int64_t, float *);
// Sixteen rows (row_bytes apart) times NV activations: (w, row_bytes, nb, xq, xs, out, out_stride).
using rows_fn = void (*)(const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, float *, int64_t);
// The most activations any kernel multiplies per pass over a row: 16 for IQ4_XS's on AVX-512, whose decoding of
// a block (its transposes and table lookups: 40% of an 8-vector pass) then serves twice as many; 8 elsewhere.
constexpr int max_nv = 16;
constexpr int group_rows = 16; // the rows a rows_fn takes

// Sixteen rows times any number of activations n: (w, row_bytes, nb, xq, xs, n, out, out_stride), for a prompt.
using many_fn = void (*)(const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *, int64_t);
// How x is laid out for a kernel set: q8_32 (the 32-element types, every kernel), q8_256 (the K-quants
// but on AVX-512), q8_k512 in natural order (AVX-512's Q6_K) or paired sub-blocks (its Q4_K, Q5_K).
enum class act { q8_256, q8_32, f32, q8_k512, q8_k512_paired };

struct kernel_set {
    act     activation;
    int     block_elements, block_bytes;
    int     nv;          // activations per pass: dot[0..nv-1] are set
    dot_fn  dot[max_nv]; // dot[n - 1] multiplies n activations
    // rows[n - 1]: sixteen rows times n activations, in the same activation layout, or none. A type's rows
    // kernels give each row the bits its row kernels (which take a matrix's last rows, past its whole
    // groups of 16) give it: the same integer sums per block, the same float operations after them. So a
    // sequence's logits depend neither on the batch it is in nor on where a row falls in a matrix;
    // tests/test_quant_kernels.py holds them to it.
    rows_fn rows[max_nv];
    // many: sixteen rows times more than nv activations at once, with the bits rows[] gives, or none: where a
    // block's decoding is a large part of a pass, decoded once for all of a prompt's vectors (IQ4_XS).
    many_fn many = nullptr;
};

template <template <int> class D, int... NV>
kernel_set make_set(act a, int elements, int bytes, std::integer_sequence<int, NV...>) {
    kernel_set k{a, elements, bytes, static_cast<int>(sizeof...(NV)), {}, {}};
    ((k.dot[NV] = D<NV + 1>::fn), ...);
    return k;
}

// Kernels with a fixed type K and every width up to N: wrappers that name the template's row function.
template <int N> using upto = std::make_integer_sequence<int, N>;
#define PEBBLE_DOT(name, fn_template)                                                  \
    template <int K> struct name {                                                      \
        template <int NV> struct at { static constexpr dot_fn fn = fn_template<K, NV>; }; \
    };

// The portable and AVX2 kernels take 4 activations a pass (AVX2 has 16 registers), AVX-512's 8 (IQ4_XS's 16).
template <template <int> class D, int K> kernel_set set_of(act a, int elements, int bytes, int nv_count) {
    return nv_count == 16 ? make_set<D<K>::template at>(a, elements, bytes, upto<16>{})
           : nv_count == 8 ? make_set<D<K>::template at>(a, elements, bytes, upto<8>{})
                           : make_set<D<K>::template at>(a, elements, bytes, upto<4>{});
}

#ifdef PEBBLE_X86
// A kernel set with sixteen-row kernels R<n>::fn beside its row kernels.
template <template <int> class R, int... NV>
kernel_set with_rows(kernel_set k, std::integer_sequence<int, NV...>) {
    ((k.rows[NV] = R<NV + 1>::fn), ...);
    return k;
}
#endif

// Each family's kernel sets for a type of the family and this CPU's instruction set: the float types
// (cpu/matvec_float.cc), the 32-element types (cpu/matvec_32.cc), the K-quants (cpu/matvec_k.cc), the
// low-bit types Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 (cpu/matvec_low.cc).
kernel_set float_kernels(int32_t type, simd level);
kernel_set block32_kernels(int32_t type, simd level);
kernel_set k_quant_kernels(int32_t type, simd level);
kernel_set low_bit_kernels(int32_t type, simd level);

// x's n_tok vectors laid out for kernel set k (cpu/quantize.cc).
pebble_status quantize_x(const kernel_set & k, int32_t ggml_type, int64_t n_cols, const void * x, bool x_f32,
                         int64_t n_tok, bool exact_f32, const char * fn, uint8_t ** out, int64_t * xs_out);

} // namespace pebble_cpu

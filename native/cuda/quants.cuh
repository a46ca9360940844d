// cuda/quants.cuh: the GGUF types the library computes from (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4): each type's block layout and its decoder, and the one
// table of the types with kernels.
// Each type's block decoding is written once, as __host__ __device__ functions that hand every element to a
// callback, for the GPU's kernels and for the host build (where the CUDA qualifiers are empty), so that CI and
// the sanitizers run the GPU's own decoding. A new type is one block struct here (and its dot product with
// 8-bit x in cuda/vecdot.cuh). Not part of the ABI.
#pragma once

#include "pebble_device.h"
#include "pebble_internal.h"

#include <cstdint>
#include <cstring>

namespace pebble_internal {

// ---------------------------------------------------------------------------------------------------
// loads (GGUF and every target here are little-endian)

// Block fields sit at any even or odd offset (blocks are 17, 18, 34, 110, 144, 210 bytes): read them bytewise.
__host__ __device__ inline uint16_t load_u16(const uint8_t * p) {
    return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

// 4 bytes at p as a word, on the GPU in one load where p is 4-byte aligned (Q2_K's and IQ4_XS's fields in a
// 4-byte aligned tensor) and two where it is 2-byte aligned (Q3_K's).
__host__ __device__ inline uint32_t load_u32(const uint8_t * p) {
#ifdef __CUDA_ARCH__
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    if ((addr & 3) == 0) return *reinterpret_cast<const uint32_t *>(p);
    if ((addr & 1) == 0) {
        const uint16_t * p16 = reinterpret_cast<const uint16_t *>(p);
        return p16[0] | static_cast<uint32_t>(p16[1]) << 16;
    }
#endif
    return load_u16(p) | static_cast<uint32_t>(load_u16(p + 2)) << 16;
}

__host__ __device__ inline int int8_from(uint32_t byte) { return static_cast<int>(byte ^ 0x80) - 128; }

#ifndef PEBBLE_MATVEC_WIDE_LOADS // 1: 8-byte loads where p is 8-byte aligned, and shifted 4-byte loads where it is
#    define PEBBLE_MATVEC_WIDE_LOADS 0 // only 2-byte aligned (half of Q6_K's and Q8_0's blocks); a variant to time
#endif
// N bytes at p into 32-bit words, on the GPU with the widest load p's alignment allows: Q4_K's nibbles
// are always 16-byte aligned in a 16-byte aligned tensor; fields of the odd-sized blocks fall at 2- or
// 4-byte alignment depending on the block's index.
template <int N>
__host__ __device__ inline void load_words(uint32_t (&out)[N / 4], const uint8_t * p) {
    static_assert(N % 16 == 0, "loads are whole 16-byte vectors");
#ifdef __CUDA_ARCH__
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    if ((addr & 15) == 0) {
        PEBBLE_UNROLL
        for (int i = 0; i < N / 16; i++) {
            const uint4 v = reinterpret_cast<const uint4 *>(p)[i];
            out[4 * i + 0] = v.x;
            out[4 * i + 1] = v.y;
            out[4 * i + 2] = v.z;
            out[4 * i + 3] = v.w;
        }
#if PEBBLE_MATVEC_WIDE_LOADS
    } else if ((addr & 7) == 0) { // 8 bytes a load
        PEBBLE_UNROLL
        for (int i = 0; i < N / 8; i++) {
            const uint2 v = reinterpret_cast<const uint2 *>(p)[i];
            out[2 * i] = v.x;
            out[2 * i + 1] = v.y;
        }
#endif
    } else if ((addr & 3) == 0) {
        PEBBLE_UNROLL
        for (int i = 0; i < N / 4; i++) out[i] = reinterpret_cast<const uint32_t *>(p)[i];
    } else if ((addr & 1) == 0) {
#if PEBBLE_MATVEC_WIDE_LOADS
        // The aligned words from p - 2 on, each word of out the high half of one and the low half of the next:
        // N / 4 + 1 loads where 16-bit loads take N / 2. The two bytes at p - 2 are read and dropped: they lie
        // in the same block (the field is not at its start), in the block before (a block this aligned is not
        // a tensor's first where tensors are 16-byte aligned, as the store, the slots and CuPy place them), or
        // else in the 16 bytes before the tensor. Nothing past p + N is read: out's last half is a 16-bit load.
        const uint32_t * w = reinterpret_cast<const uint32_t *>(p - 2);
        uint32_t lo = w[0];
        PEBBLE_UNROLL
        for (int i = 0; i < N / 4 - 1; i++) {
            const uint32_t hi = w[i + 1];
            out[i] = __funnelshift_r(lo, hi, 16);
            lo = hi;
        }
        out[N / 4 - 1] = (lo >> 16) | static_cast<uint32_t>(reinterpret_cast<const uint16_t *>(p)[N / 2 - 1]) << 16;
#else
        const uint16_t * p16 = reinterpret_cast<const uint16_t *>(p);
        PEBBLE_UNROLL
        for (int i = 0; i < N / 4; i++) out[i] = p16[2 * i] | static_cast<uint32_t>(p16[2 * i + 1]) << 16;
#endif
    } else {
        PEBBLE_UNROLL
        for (int i = 0; i < N / 4; i++) {
            out[i] = p[4 * i] | p[4 * i + 1] << 8 | p[4 * i + 2] << 16 | static_cast<uint32_t>(p[4 * i + 3]) << 24;
        }
    }
#else
    memcpy(out, p, N);
#endif
}

__host__ __device__ inline uint32_t byte_of(const uint32_t * words, int i) {
    return (words[i >> 2] >> (8 * (i & 3))) & 0xff;
}

#ifdef PEBBLE_HOST_BUILD
struct uint4 { uint32_t x, y, z, w; }; // CUDA's 16-byte vector, for the host's run of the parts below
#endif

// a + the sum of the four products of a's and b's signed bytes (dp4a's arithmetic, on the host in C++).
__host__ __device__ inline int dot4(int a, int b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; i++) c += static_cast<int8_t>(a >> (8 * i)) * static_cast<int8_t>(b >> (8 * i));
    return c;
#endif
}

// Byte n of the result is byte s_n & 7 of x (0..3) and y (4..7), s_n being nibble n of s's low 16 bits
// (__byte_perm's arithmetic, one PRMT, on the host in C++).
__host__ __device__ inline uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    const uint64_t bytes = x | static_cast<uint64_t>(y) << 32;
    uint32_t r = 0;
    for (int n = 0; n < 4; n++) r |= static_cast<uint32_t>(bytes >> (8 * ((s >> (4 * n)) & 7)) & 0xff) << (8 * n);
    return r;
#endif
}

// Tables of 16 int8 (IQ4_NL's and IQ4_XS's values, MXFP4's doubled e2m1 values) are two 64-bit constants in
// the type's struct, entries 0..7 in the bytes of lo and 8..15 in those of hi: device code may use a
// constexpr scalar, where a constexpr array could not be indexed at run time.
template <typename Table> __host__ __device__ inline int table_entry(uint32_t i) {
    constexpr uint64_t lo = Table::values_lo, hi = Table::values_hi;
    return int8_from(static_cast<uint32_t>(((i & 8 ? hi : lo) >> (8 * (i & 7))) & 0xff));
}

// The entries for the eight nibbles of q, as bytes: lo those of its bytes' low nibbles, hi those of their high
// nibbles (byte k of each for byte k of q). Each half of q's nibbles picks from entries 0..7 and 8..15 by
// their low three bits, then between the two by the fourth, then the bytes are sorted by nibble: six byte
// permutes for eight entries (as ggml-cuda's get_int_from_table_16).
template <typename Table> __host__ __device__ inline void table_lookup(uint32_t q, uint32_t & lo, uint32_t & hi) {
    constexpr uint32_t t0 = static_cast<uint32_t>(Table::values_lo), t1 = static_cast<uint32_t>(Table::values_lo >> 32);
    constexpr uint32_t t2 = static_cast<uint32_t>(Table::values_hi), t3 = static_cast<uint32_t>(Table::values_hi >> 32);
    const uint32_t upper = 0x32103210u | ((q & 0x88888888u) >> 1); // nibble n: byte n % 4 of the low (0..3) or high (4..7) pick
    uint32_t picked[2]; // the entries of nibbles 0..3, then 4..7
    PEBBLE_UNROLL
    for (int i = 0; i < 2; i++) {
        const uint32_t s = q >> (16 * i);
        picked[i] = byte_perm(byte_perm(t0, t1, s), byte_perm(t2, t3, s), upper >> (16 * i));
    }
    lo = byte_perm(picked[0], picked[1], 0x6420);
    hi = byte_perm(picked[0], picked[1], 0x7531);
}

// 16 bytes at p, in one load on the GPU (p 16-byte aligned: the launcher checks the weights' alignment).
__host__ __device__ inline uint4 load_16(const uint8_t * __restrict__ p) {
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const uint4 *>(p);
#else
    uint4 v;
    memcpy(&v, p, sizeof v);
    return v;
#endif
}

// ---------------------------------------------------------------------------------------------------
// blocks: one struct per type, with GGML's block size and a decoder
//
// decode(block, part, emit) calls emit(i, value) for the elements of one part of a block, i being an
// element's index in the block. A part is one thread's unit of work: a whole block for the small types,
// a quarter of a 256-element super-block, so that a lane holds 32 bytes of payload in registers and
// neighbouring lanes read neighbouring bytes. The float32 operations, and their order, are gguf-py's
// dequantize's, so that the results equal it bit for bit.

struct type_f32 {
    static constexpr int32_t id = 0;
    static constexpr int block_elements = 1, block_bytes = 4, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        emit(0, float_from_bits(load_u16(b) | static_cast<uint32_t>(load_u16(b + 2)) << 16));
    }
};

struct type_f16 {
    static constexpr int32_t id = 1;
    static constexpr int block_elements = 1, block_bytes = 2, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        emit(0, half_to_float(load_u16(b)));
    }
};

struct type_bf16 { // the top half of a float32
    static constexpr int32_t id = 30;
    static constexpr int block_elements = 1, block_bytes = 2, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        emit(0, float_from_bits(static_cast<uint32_t>(load_u16(b)) << 16));
    }
};

// fp16 d, then 16 bytes of nibbles: element i < 16 is the low nibble of byte i, element 16 + i its high
// nibble; value (q - 8) * d.
struct type_q4_0 {
    static constexpr int32_t id = 2;
    static constexpr int block_elements = 32, block_bytes = 18, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        const float d = half_to_float(load_u16(b));
        uint32_t qs[4];
        load_words<16>(qs, b + 2);
        PEBBLE_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint32_t q = byte_of(qs, i);
            emit(i,      d * static_cast<float>(static_cast<int>(q & 0xf) - 8));
            emit(i + 16, d * static_cast<float>(static_cast<int>(q >> 4) - 8));
        }
    }
};

// fp16 d, then 32 int8: value q * d.
struct type_q8_0 {
    static constexpr int32_t id = 8;
    static constexpr int block_elements = 32, block_bytes = 34, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        const float d = half_to_float(load_u16(b));
        uint32_t qs[8];
        load_words<32>(qs, b + 2);
        PEBBLE_UNROLL
        for (int i = 0; i < 32; i++) emit(i, d * static_cast<float>(int8_from(byte_of(qs, i))));
    }
};

// fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of nibbles. Sub-block j
// (32 elements) is nibble j % 2 of bytes 32 * (j / 2) .. + 31; value d * scale_j * q - dmin * min_j.
// Part p is sub-blocks 2p and 2p + 1, which share their bytes.
struct type_q4_k {
    static constexpr int32_t id = 12;
    static constexpr int block_elements = 256, block_bytes = 144, parts = 4;

    // Scales and mins 0..3 are the low 6 bits of bytes 0..3 and 4..7; 4..7 are a nibble of bytes 8..11
    // with the top two bits of bytes 0..3 (scales) or 4..7 (mins) above it.
    template <typename Bytes> // a pointer to the 12 bytes, or anything else that indexes them
    __host__ __device__ static void scale_min(const Bytes & s, int j, int & scale, int & min) {
        if (j < 4) {
            scale = s[j] & 63;
            min   = s[j + 4] & 63;
        } else {
            scale = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
            min   = (s[j + 4] >> 4)  | ((s[j] >> 6) << 4);
        }
    }

    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int part, Emit & emit) {
        const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        int sc0, m0, sc1, m1;
        scale_min(b + 4, 2 * part, sc0, m0);
        scale_min(b + 4, 2 * part + 1, sc1, m1);
        // Each product is exact in float32 (11 + 6 + 4 bits), so only the difference rounds, whether or
        // not the compiler fuses it into an FMA.
        const float d0 = d * static_cast<float>(sc0), min0 = dmin * static_cast<float>(m0);
        const float d1 = d * static_cast<float>(sc1), min1 = dmin * static_cast<float>(m1);
        uint32_t qs[8];
        load_words<32>(qs, b + 16 + 32 * part);
        PEBBLE_UNROLL
        for (int i = 0; i < 32; i++) {
            const uint32_t q = byte_of(qs, i);
            emit(64 * part + i,      d0 * static_cast<float>(q & 0xf) - min0);
            emit(64 * part + 32 + i, d1 * static_cast<float>(q >> 4) - min1);
        }
    }
};

// fp16 d, fp16 m, then 16 bytes of nibbles laid out as Q4_0's; value d * q + m (the product is exact in
// float32, so only the sum rounds).
struct type_q4_1 {
    static constexpr int32_t id = 3;
    static constexpr int block_elements = 32, block_bytes = 20, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        const float d = half_to_float(load_u16(b)), m = half_to_float(load_u16(b + 2));
        uint32_t qs[4];
        load_words<16>(qs, b + 4);
        PEBBLE_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint32_t q = byte_of(qs, i);
            emit(i,      d * static_cast<float>(q & 0xf) + m);
            emit(i + 16, d * static_cast<float>(q >> 4) + m);
        }
    }
};

// The fifth bit of each of 32 elements, element j's in bit j of a little-endian uint32 at p.
__host__ __device__ inline uint32_t load_high_bits(const uint8_t * p) {
    return load_u16(p) | static_cast<uint32_t>(load_u16(p + 2)) << 16;
}

// fp16 d, 4 bytes of fifth bits, 16 bytes of low nibbles laid out as Q4_0's; value d * (q - 16).
struct type_q5_0 {
    static constexpr int32_t id = 6;
    static constexpr int block_elements = 32, block_bytes = 22, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        const float d = half_to_float(load_u16(b));
        const uint32_t qh = load_high_bits(b + 2);
        uint32_t qs[4];
        load_words<16>(qs, b + 6);
        PEBBLE_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint32_t q = byte_of(qs, i);
            const int lo = static_cast<int>((q & 0xf) | ((qh >> i) & 1) << 4) - 16;
            const int hi = static_cast<int>((q >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16;
            emit(i,      d * static_cast<float>(lo));
            emit(i + 16, d * static_cast<float>(hi));
        }
    }
};

// fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of low nibbles; value d * q + m.
struct type_q5_1 {
    static constexpr int32_t id = 7;
    static constexpr int block_elements = 32, block_bytes = 24, parts = 1;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        const float d = half_to_float(load_u16(b)), m = half_to_float(load_u16(b + 2));
        const uint32_t qh = load_high_bits(b + 4);
        uint32_t qs[4];
        load_words<16>(qs, b + 8);
        PEBBLE_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint32_t q = byte_of(qs, i);
            emit(i,      d * static_cast<float>((q & 0xf) | ((qh >> i) & 1) << 4) + m);
            emit(i + 16, d * static_cast<float>((q >> 4) | ((qh >> (i + 16)) & 1) << 4) + m);
        }
    }
};

// fp16 d, fp16 dmin, Q4_K's 12 bytes of scales and mins, 32 bytes of fifth bits (sub-block j's in bit
// j of byte l, for element l), 128 bytes of low nibbles laid out as Q4_K's; value d * scale_j * q -
// dmin * min_j. Part p is sub-blocks 2p and 2p + 1, as in Q4_K.
struct type_q5_k {
    static constexpr int32_t id = 13;
    static constexpr int block_elements = 256, block_bytes = 176, parts = 4;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int part, Emit & emit) {
        const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        int sc0, m0, sc1, m1;
        type_q4_k::scale_min(b + 4, 2 * part, sc0, m0);
        type_q4_k::scale_min(b + 4, 2 * part + 1, sc1, m1);
        const float d0 = d * static_cast<float>(sc0), min0 = dmin * static_cast<float>(m0);
        const float d1 = d * static_cast<float>(sc1), min1 = dmin * static_cast<float>(m1);
        uint32_t qh[8], qs[8];
        load_words<32>(qh, b + 16);
        load_words<32>(qs, b + 48 + 32 * part);
        PEBBLE_UNROLL
        for (int i = 0; i < 32; i++) {
            const uint32_t q = byte_of(qs, i), h = byte_of(qh, i);
            emit(64 * part + i,      d0 * static_cast<float>((q & 0xf) | ((h >> (2 * part)) & 1) << 4) - min0);
            emit(64 * part + 32 + i, d1 * static_cast<float>((q >> 4) | ((h >> (2 * part + 1)) & 1) << 4) - min1);
        }
    }
};

// 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; two halves of 128 elements. Element 128h + 32j + l
// (quarter j < 4, l < 32) has 6 bits: nibble j / 2 of ql[64h + 32 (j % 2) + l] below bits 2j, 2j + 1 of
// qh[32h + l]; value (d * scales[8h + 2j + l / 16]) * (q - 32), as gguf computes it (the first product
// is exact in float32, so the value is rounded once). Part p is half p / 2, quarters p % 2 and
// p % 2 + 2, which share their ql bytes.
struct type_q6_k {
    static constexpr int32_t id = 14;
    static constexpr int block_elements = 256, block_bytes = 210, parts = 4;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int part, Emit & emit) {
        const int h = part >> 1, j = part & 1;
        const float d = half_to_float(load_u16(b + 208));
        const uint8_t * scales = b + 192 + 8 * h;
        const float d_lo[2] = {d * static_cast<float>(int8_from(scales[2 * j])),
                               d * static_cast<float>(int8_from(scales[2 * j + 1]))};
        const float d_hi[2] = {d * static_cast<float>(int8_from(scales[2 * j + 4])),
                               d * static_cast<float>(int8_from(scales[2 * j + 5]))};
        uint32_t ql[8], qh[8];
        load_words<32>(ql, b + 64 * h + 32 * j);
        load_words<32>(qh, b + 128 + 32 * h);
        PEBBLE_UNROLL
        for (int l = 0; l < 32; l++) {
            const uint32_t lo = byte_of(ql, l), hi = byte_of(qh, l);
            const int q_lo = static_cast<int>((lo & 0xf) | (((hi >> (2 * j)) & 3) << 4)) - 32;
            const int q_hi = static_cast<int>((lo >> 4) | (((hi >> (2 * j + 4)) & 3) << 4)) - 32;
            emit(128 * h + 32 * j + l,       d_lo[l >> 4] * static_cast<float>(q_lo));
            emit(128 * h + 32 * (j + 2) + l, d_hi[l >> 4] * static_cast<float>(q_hi));
        }
    }
};

// 16 bytes scales (scale_g in the low nibble of byte g, min_g in its high), 64 bytes of 2-bit q, fp16 d, fp16
// dmin. Element 128h + 32s + l (s < 4, l < 32) is bits 2s, 2s + 1 of qs[32h + l], in group (16 elements)
// e / 16; value (d * scale_g) * q - dmin * min_g (both products exact in float32: the difference rounds
// once). Part p is h = p / 2, s = 2 (p % 2) and s + 1, which share 32 bytes of qs.
struct type_q2_k {
    static constexpr int32_t id = 10;
    static constexpr int block_elements = 256, block_bytes = 84, parts = 4;
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int part, Emit & emit) {
        const float d = half_to_float(load_u16(b + 80)), dmin = half_to_float(load_u16(b + 82));
        const int shift = 4 * (part & 1);
        float dl[4], ml[4];
        PEBBLE_UNROLL
        for (int g = 0; g < 4; g++) {
            const uint32_t sc = b[4 * part + g];
            dl[g] = d * static_cast<float>(sc & 0xf);
            ml[g] = dmin * static_cast<float>(sc >> 4);
        }
        uint32_t qs[8];
        load_words<32>(qs, b + 16 + 32 * (part >> 1));
        PEBBLE_UNROLL
        for (int l = 0; l < 32; l++) {
            const uint32_t q = byte_of(qs, l);
            emit(64 * part + l,      dl[l >> 4] * static_cast<float>((q >> shift) & 3) - ml[l >> 4]);
            emit(64 * part + 32 + l, dl[2 + (l >> 4)] * static_cast<float>((q >> (shift + 2)) & 3) - ml[2 + (l >> 4)]);
        }
    }
};

// 32 bytes hmask, 64 bytes of 2-bit q, 12 bytes of sixteen 6-bit scales, fp16 d. Element 128h + 32s + l
// (s < 4, l < 32) has low bits 2s, 2s + 1 of qs[32h + l] and high bit 4h + s of hmask[l]: q = (low | high
// << 2) - 4 (the offset is there where the bit is clear); value (d * (scale_g - 32)) * q, g = e / 16 (exact
// in float32). Part p is h = p / 2, s = 2 (p % 2) and s + 1, as in Q2_K.
struct type_q3_k {
    static constexpr int32_t id = 11;
    static constexpr int block_elements = 256, block_bytes = 110, parts = 4;

    // Scale 4 part + g (g < 4) less 32: its low nibble is nibble part / 2 of scale byte (4 part + g) % 8
    // (byte g of `low`, the word at 96 + 4 (part % 2)), its top two bits are bits 2 part, 2 part + 1 of byte
    // 8 + g (byte g of `high`, the word at 104).
    __host__ __device__ static int scale(uint32_t low, uint32_t high, int part, int g) {
        return static_cast<int>(((low >> (8 * g + 4 * (part >> 1))) & 0xf) | ((high >> (8 * g + 2 * part)) & 3) << 4) - 32;
    }

    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int part, Emit & emit) {
        const int h = part >> 1, s = 2 * (part & 1);
        const float d = half_to_float(load_u16(b + 108));
        const uint32_t low = load_u32(b + 96 + 4 * (part & 1)), high = load_u32(b + 104);
        float dl[4];
        PEBBLE_UNROLL
        for (int g = 0; g < 4; g++) dl[g] = d * static_cast<float>(scale(low, high, part, g));
        uint32_t hm[8], qs[8];
        load_words<32>(hm, b);
        load_words<32>(qs, b + 32 + 32 * h);
        PEBBLE_UNROLL
        for (int l = 0; l < 32; l++) {
            const uint32_t q = byte_of(qs, l), m = byte_of(hm, l);
            const int q_a = static_cast<int>(((q >> (2 * s)) & 3) | ((m >> (4 * h + s)) & 1) << 2) - 4;
            const int q_b = static_cast<int>(((q >> (2 * s + 2)) & 3) | ((m >> (4 * h + s + 1)) & 1) << 2) - 4;
            emit(64 * part + l,      dl[l >> 4] * static_cast<float>(q_a));
            emit(64 * part + 32 + l, dl[2 + (l >> 4)] * static_cast<float>(q_b));
        }
    }
};

// fp16 d, then 16 bytes of nibbles laid out as Q4_0's, each the index of a value in a table of 16 int8
// (a non-linear grid); value d * values[q] (exact in float32).
struct type_iq4_nl {
    static constexpr int32_t id = 20;
    static constexpr int block_elements = 32, block_bytes = 18, parts = 1;
    static constexpr uint64_t values_lo = iq4_values_lo, values_hi = iq4_values_hi; // pebble_device.h
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        const float d = half_to_float(load_u16(b));
        uint32_t qs[4];
        load_words<16>(qs, b + 2);
        PEBBLE_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint32_t q = byte_of(qs, i);
            emit(i,      d * static_cast<float>(table_entry<type_iq4_nl>(q & 0xf)));
            emit(i + 16, d * static_cast<float>(table_entry<type_iq4_nl>(q >> 4)));
        }
    }
};

// fp16 d, 2 bytes of the scales' top two bits (sub-block j's bits 2j, 2j + 1 of the little-endian uint16), 4
// bytes of the scales' low nibbles (sub-block j's nibble j % 2 of byte j / 2), 128 bytes of nibbles: sub-block
// j (32 elements) is bytes 16j .. 16j + 15, element i < 16 the low nibble of byte i and 16 + i its high one,
// each an index into IQ4_NL's table; value (d * (scale_j - 32)) * values[q] (exact in float32). Part p is
// sub-blocks 2p and 2p + 1: 32 bytes.
struct type_iq4_xs {
    static constexpr int32_t id = 23;
    static constexpr int block_elements = 256, block_bytes = 136, parts = 4;

    // Sub-block j's scale less 32, from the block's first 4 bytes (head: d, then the top bits) and next 4 (low).
    __host__ __device__ static int scale(uint32_t head, uint32_t low, int j) {
        return static_cast<int>(((low >> (4 * j)) & 0xf) | ((head >> (16 + 2 * j)) & 3) << 4) - 32;
    }

    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int part, Emit & emit) {
        const uint32_t head = load_u32(b), low = load_u32(b + 4);
        const float d = half_to_float(static_cast<uint16_t>(head));
        const float d_a = d * static_cast<float>(scale(head, low, 2 * part));
        const float d_b = d * static_cast<float>(scale(head, low, 2 * part + 1));
        uint32_t qs[8];
        load_words<32>(qs, b + 8 + 32 * part);
        PEBBLE_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint32_t q_a = byte_of(qs, i), q_b = byte_of(qs, 16 + i);
            emit(64 * part + i,      d_a * static_cast<float>(table_entry<type_iq4_nl>(q_a & 0xf)));
            emit(64 * part + 16 + i, d_a * static_cast<float>(table_entry<type_iq4_nl>(q_a >> 4)));
            emit(64 * part + 32 + i, d_b * static_cast<float>(table_entry<type_iq4_nl>(q_b & 0xf)));
            emit(64 * part + 48 + i, d_b * static_cast<float>(table_entry<type_iq4_nl>(q_b >> 4)));
        }
    }
};

// An E8M0 byte e, then 16 bytes of nibbles laid out as Q4_0's, each the index of a doubled e2m1 value (0, 1,
// 2, 3, 4, 6, 8, 12 and their negatives); value e8m0_half(e) * values[q]: a power of two times an integer
// of at most 2 significant bits, exact in float32 (subnormals too) but where it overflows to infinity.
struct type_mxfp4 {
    static constexpr int32_t id = 39;
    static constexpr int block_elements = 32, block_bytes = 17, parts = 1;
    static constexpr uint64_t values_lo = mxfp4_values_lo, values_hi = mxfp4_values_hi; // pebble_device.h
    template <typename Emit> __host__ __device__ static void decode(const uint8_t * b, int, Emit & emit) {
        const float d = e8m0_half(b[0]);
        uint32_t qs[4];
        load_words<16>(qs, b + 1);
        PEBBLE_UNROLL
        for (int i = 0; i < 16; i++) {
            const uint32_t q = byte_of(qs, i);
            emit(i,      d * static_cast<float>(table_entry<type_mxfp4>(q & 0xf)));
            emit(i + 16, d * static_cast<float>(table_entry<type_mxfp4>(q >> 4)));
        }
    }
};

// ---------------------------------------------------------------------------------------------------
// staging

// Where element e of a stretch staged in shared memory lies, in elements of `Size` bytes: one 4-byte word of
// padding every 64 elements, so that threads a part (32 or 64 elements) apart use different banks. Size 2
// for fp16 stretches, 1 for 8-bit x.
template <int Size> __host__ __device__ inline int staged_at(int e) { return e + 4 / Size * (e >> 6); }

// ---------------------------------------------------------------------------------------------------
// the table of the types with kernels

// GGUF type names, for messages ("?" for ids without a type): cuda/quants.cu.
const char * type_name(int32_t ggml_type);

#define SUPPORTED_TYPES "0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, " \
                        "14 Q6_K, 20 IQ4_NL, 23 IQ4_XS, 30 BF16, 39 MXFP4"

// Calls f(T{}) with the block type of `ggml_type` and returns true, or false for a type without kernels;
// the one list of the types with kernels.
template <typename F>
bool visit_type(int32_t ggml_type, F && f) {
    switch (ggml_type) {
        case type_f32::id:  f(type_f32{});  return true;
        case type_f16::id:  f(type_f16{});  return true;
        case type_bf16::id: f(type_bf16{}); return true;
        case type_q4_0::id: f(type_q4_0{}); return true;
        case type_q8_0::id: f(type_q8_0{}); return true;
        case type_q4_k::id: f(type_q4_k{}); return true;
        case type_q6_k::id: f(type_q6_k{}); return true;
        case type_q4_1::id: f(type_q4_1{}); return true;
        case type_q5_0::id: f(type_q5_0{}); return true;
        case type_q5_1::id: f(type_q5_1{}); return true;
        case type_q5_k::id: f(type_q5_k{}); return true;
        case type_q2_k::id: f(type_q2_k{}); return true;
        case type_q3_k::id: f(type_q3_k{}); return true;
        case type_iq4_nl::id: f(type_iq4_nl{}); return true;
        case type_iq4_xs::id: f(type_iq4_xs{}); return true;
        case type_mxfp4::id: f(type_mxfp4{}); return true;
    }
    return false;
}

// f(T{}) for the block type of `ggml_type`, or a failure naming `fn` for a type without kernels.
template <typename F>
pebble_status with_type(int32_t ggml_type, const char * fn, F && f) {
    pebble_status st = PEBBLE_OK;
    if (visit_type(ggml_type, [&](auto t) { st = f(t); })) return st;
    if (ggml_type >= 0 && ggml_type < PEBBLE_TYPE_COUNT && type_name(ggml_type)[0] != '?') {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: GGUF type %d (%s) has no kernels; supported: " SUPPORTED_TYPES,
                    fn, ggml_type, type_name(ggml_type));
    }
    return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %d is not a GGUF type id; supported: " SUPPORTED_TYPES, fn,
                ggml_type);
}

// PEBBLE_OK when `ggml_type` has kernels and n_rows x n_cols are whole rows of its blocks, else a failure
// naming `fn` and `what` (cuda/quants.cu).
pebble_status check_matrix(const char * fn, const char * what, int32_t ggml_type, int64_t n_rows, int64_t n_cols);

} // namespace pebble_internal

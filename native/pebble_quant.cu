// pebble_quant.cu: kernels that compute from GGUF-quantized tensors (the "quantized tensors" part of
// pebble.h), so that weights stay in their stored form on the device and on the bus.
//
// pebble_dequantize expands a tensor to fp16: prefill expands one layer at a time into a reused
// workspace that cuBLAS multiplies. pebble_matvec multiplies quantized weights by 1..8 fp16 vectors:
// in decode, reading the weights is the whole cost, so each block is read once and decoded in registers.
//
// Each type's block decoding is written once, as __host__ __device__ functions that hand every element
// to a callback, and each kernel is written once. In the host build (-DPEBBLE_HOST_BUILD) a kernel is a
// plain function that loops over its share of the work (the launcher splits blocks among the host's
// thread pool when there are enough of them), a warp has one lane, and the CUDA qualifiers are empty:
// CI and the sanitizers run the GPU's dequantization. The host build's matvec is not the GPU's kernel:
// it is cpu/matmul.cc's, which quantizes x to 8-bit blocks and multiplies with integer SIMD dot
// products, as llama.cpp's CPU backend does (pebble.h says what that changes in the results); with
// PEBBLING_SIMD=gpu it runs the GPU integer and dense kernels' code for each lane instead (host_q8_matvec,
// host_dense_matvec).

#include "pebble_device.h"
#include "pebble_internal.h"

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#ifdef PEBBLE_HOST_BUILD
#    include "cpu/cpu.h"
#endif


using namespace pebble_internal;

namespace {

// ---------------------------------------------------------------------------------------------------
// loads (GGUF and every target here are little-endian)

// Block fields sit at any even or odd offset (blocks are 18, 34, 144, 210 bytes): read them bytewise.
__host__ __device__ inline uint16_t load_u16(const uint8_t * p) {
    return static_cast<uint16_t>(p[0] | (p[1] << 8));
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

// ---------------------------------------------------------------------------------------------------
// kernels

// One thread per part of a block, grid-strided.
template <typename T>
__global__ void dequantize_kernel(const uint8_t * __restrict__ src, uint16_t * __restrict__ dst, int64_t n_parts) {
    for (int64_t p = grid_thread(); p < n_parts; p += grid_threads()) {
        const int64_t block = p / T::parts;
        uint16_t * out = dst + block * T::block_elements;
        auto emit = [out](int i, float value) { out[i] = half_from_float(value); };
        T::decode(src + block * T::block_bytes, static_cast<int>(p % T::parts), emit);
    }
}

// Where element e of a stretch staged in shared memory lies, in elements of `Size` bytes: one 4-byte word of
// padding every 64 elements, so that threads a part (32 or 64 elements) apart use different banks. Size 2
// for fp16 stretches, 1 for 8-bit x.
template <int Size> __host__ __device__ inline int staged_at(int e) { return e + 4 / Size * (e >> 6); }

#ifndef PEBBLE_HOST_BUILD
constexpr int dequantize_threads = 256;

// dequantize_kernel for block types (32 or more elements a part): a thread block's parts are
// consecutive, so their elements are one stretch of the output; each thread decodes its part into shared
// memory and the block then stores the stretch in 4-byte words, consecutive threads consecutive words.
// (Stored where they were decoded, each thread's 2-byte stores landed 64 or 128 bytes from its
// neighbours', 32 lines a warp-wide store: about 180 GB/s on an H200.) The same halves, bit for bit.
template <typename T>
__global__ void __launch_bounds__(dequantize_threads)
dequantize_tiled_kernel(const uint8_t * __restrict__ src, uint16_t * __restrict__ dst, int64_t n_parts) {
    constexpr int part_elements = T::block_elements / T::parts, tile = dequantize_threads * part_elements;
    static_assert(part_elements % 64 == 0 || part_elements == 32, "parts of whole padding groups or half of one");
    static_assert(dequantize_threads % T::parts == 0, "a tile is whole blocks");
    __shared__ __align__(16) uint16_t staged[tile + 2 * (tile / 64)];
    for (int64_t first = int64_t(blockIdx.x) * dequantize_threads; first < n_parts;
         first += int64_t(gridDim.x) * dequantize_threads) {
        const int64_t p = first + threadIdx.x, tile_start = first * part_elements;
        if (p < n_parts) {
            const int64_t block = p / T::parts;
            const int offset = static_cast<int>(block * T::block_elements - tile_start); // the block's element 0
            auto emit = [&](int i, float value) { staged[staged_at<2>(offset + i)] = half_from_float(value); };
            T::decode(src + block * T::block_bytes, static_cast<int>(p % T::parts), emit);
        }
        __syncthreads();
        const int64_t parts_here = n_parts - first < dequantize_threads ? n_parts - first : dequantize_threads;
        const int words = static_cast<int>(parts_here * part_elements / 2);
        const uint32_t * from = reinterpret_cast<const uint32_t *>(staged);
        uint32_t * to = reinterpret_cast<uint32_t *>(dst + tile_start);
        for (int w = threadIdx.x; w < words; w += dequantize_threads) to[w] = from[w + (w >> 5)];
        __syncthreads(); // the stretch is out before the next one is decoded into the same memory
    }
}
#endif

// One warp per row (blockDim = 32 x rows per block, rows grid-strided). The lanes take the row's block
// parts in turn, so at each step the warp reads one contiguous stretch of the row, every byte of it
// once; each lane keeps NV float32 sums, reduced across the warp by shuffles at the end of the row.
// x (fp16) goes through shared memory a chunk of matvec_chunk elements at a time, loaded once for the
// thread block's rows by coalesced reads: read from global memory where it is used, each warp-wide
// load of x touched 32 lines (the lanes are a part apart), and those loads, not the weights, set the
// time. One 4-byte word of padding every 64 elements puts the lanes' reads in different banks (a lane's
// part is 32 or 64 elements). A chunk is whole rounds of the warp's parts, so each lane takes the parts
// it would take reading x from global memory, in the same order: the same sums, bit for bit.
// (The host build multiplies in cpu/matmul.cc instead, but for PEBBLING_SIMD=gpu: see host_q8_matvec.)
#ifndef PEBBLE_MATVEC_ROWS // a build may set these five to compare (benchmarks/bench_matvec.py --libs)
#    define PEBBLE_MATVEC_ROWS 16
#endif
#ifndef PEBBLE_Q8_CHUNK
#    define PEBBLE_Q8_CHUNK 4096
#endif
#ifndef PEBBLE_Q8_CHUNK_FEW // the same at one or two vectors
#    define PEBBLE_Q8_CHUNK_FEW 16384
#endif
#ifndef PEBBLE_MATVEC_UNROLL // a lane's parts of a chunk unrolled by this, so their loads can go out together
#    define PEBBLE_MATVEC_UNROLL 4
#endif
#ifndef PEBBLE_MATVEC_WARP_ROWS // rows a warp of the integer kernel takes at once at 1-2 vectors (see warp_rows)
#    define PEBBLE_MATVEC_WARP_ROWS 1
#endif
#ifndef PEBBLE_MATVEC_LOADS // parts a lane of the integer kernel loads before it sums the first (see part_loads):
#    define PEBBLE_MATVEC_LOADS 1 // H200, 11-27: 1 led 2 (also without PERSIST) and 4 at each kernel-bound shape:
#endif                           // the Q6_K output 259 us against 312 (327) and 418, 4096 x 14336 43.5 against 59.9 (49.6), 70.1
constexpr int matvec_unroll = PEBBLE_MATVEC_UNROLL;
constexpr int matvec_rows_per_block = PEBBLE_MATVEC_ROWS; // warps per thread block: rows sharing one staging of x
constexpr int matvec_warp_rows = PEBBLE_MATVEC_WARP_ROWS;
constexpr int matvec_chunk = 2048;        // x elements staged per vector at a time
constexpr int matvec_chunk_padded = matvec_chunk + 2 * (matvec_chunk / 64);
// x elements the integer kernel stages per vector at a time: at one or two vectors a 14336-column row
// (Llama-3-8B's ffn_down) fits one chunk within the 48 KB a block's static shared memory may take; more take 4096.
template <int NV> constexpr int q8_chunk = NV <= 2 ? PEBBLE_Q8_CHUNK_FEW : PEBBLE_Q8_CHUNK;
// Rows a warp of the integer kernel takes at once: matvec_warp_rows at one or two vectors, where a row's
// loads are few, for a matrix of more row groups than the GPU holds at once (fewer blocks would leave
// multiprocessors idle); one at more vectors, whose sums take the registers (two rows spilled from 4 vectors up).
template <int NV> constexpr int warp_rows = NV <= 2 ? matvec_warp_rows : 1;
// Parts a lane loads before it sums the first: PEBBLE_MATVEC_LOADS over the warp's rows at once (at least
// one), so that the registers they take stay near one row's at two (a part is 12 words of Q4_K, 20 of
// Q5_K, 21 of Q6_K).
template <int WR> constexpr int part_loads = PEBBLE_MATVEC_LOADS / WR > 1 ? PEBBLE_MATVEC_LOADS / WR : 1;

#ifndef PEBBLE_HOST_BUILD

// Row `row` of y for each of the NV vectors: the sum of the warp's lanes' acc, stored by lane 0 (every
// lane of the warp takes part in the shuffles).
template <int NV>
__device__ inline void store_row_sums(const float (&acc)[NV], int lane, float * __restrict__ y, int64_t n_rows,
                                      int64_t row) {
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const float sum = warp_sum(acc[v]);
        if (lane == 0) y[v * n_rows + row] = sum;
    }
}

// Up to max_stacked matrices of one type and width, times the same vectors, as one: part p's rows are
// rows first[p] .. first[p + 1] - 1 of the stack, its products y[p] (a step's q and k, or its gate and up,
// in one launch, staging x once for both).
constexpr int max_stacked = 4;
struct stacked_rows {
    const uint8_t * w[max_stacked];
    float *         y[max_stacked];
    int64_t         first[max_stacked + 1];
    int32_t         n;
};

// Row `row` of the stack: its matrix's row (w_row), where its sums go (y, of rows rows), and which row there.
struct stacked_row {
    const uint8_t * w_row;
    float *         y;
    int64_t         rows, row;
};

// (The parts are tried in an unrolled loop: indexed by a run-time part, the parameter was copied to each
// thread's stack, 112 bytes.)
__device__ inline stacked_row locate(const stacked_rows & m, int64_t row, int64_t row_bytes) {
    stacked_row at = {m.w[0] + row * row_bytes, m.y[0], m.first[1], row};
    PEBBLE_UNROLL
    for (int p = 1; p < max_stacked; p++) {
        if (p < m.n && row >= m.first[p]) {
            const int64_t local = row - m.first[p];
            at = {m.w[p] + local * row_bytes, m.y[p], m.first[p + 1] - m.first[p], local};
        }
    }
    return at;
}

#endif

// F16, BF16 and F32 weights, eight elements a lane's part (16 bytes of F16 or BF16, 32 of F32) in 16-byte
// loads, two parts loaded before the first is summed, where matvec_kernel's parts are single elements (a
// 2-byte load each: about 1 TB/s on an H200, a fifth of its copy rate). x is staged as matvec_kernel stages
// it; a part's products are summed into each vector's sum in element order. Rows of a multiple of 8
// elements, every matrix 16-byte aligned (PEBBLING_CUDA_DENSE=0: an element a part).
constexpr int dense_part = 8; // elements of a lane's part

template <typename T> __host__ __device__ inline float dense_value(const uint4 (&w)[T::block_bytes / 2], int i) {
    const uint32_t word = reinterpret_cast<const uint32_t *>(w)[T::block_bytes == 4 ? i : i / 2];
    if constexpr (T::id == type_f32::id) {
        return float_from_bits(word);
    } else {
        const uint32_t bits = (word >> (16 * (i % 2))) & 0xffffu;
        return T::id == type_f16::id ? half_to_float(static_cast<uint16_t>(bits)) : float_from_bits(bits << 16);
    }
}

// Lane `lane` (of Lanes)'s 8-element parts of the chunk [c0, c0 + n) of row w_row (F16, BF16 or F32), U at
// a time: their loads first, then each part's products, in element order, into acc. (On the host, for
// PEBBLING_SIMD=gpu, each of 32 lanes in turn: host_dense_matvec.)
template <typename T, int NV, int Lanes = warp_lanes>
__host__ __device__ inline void dense_parts(const uint8_t * __restrict__ w_row, int64_t c0, int n, int lane,
                                            const uint16_t (&xs)[NV][matvec_chunk_padded], float (&acc)[NV]) {
    constexpr int words = T::block_bytes / 2, U = 2; // 16-byte loads a part (1 or 2), parts loaded at once
    const uint8_t * w = w_row + c0 / dense_part * words * 16;
    const int parts = n / dense_part;
    for (int p0 = lane; p0 < parts; p0 += U * Lanes) {
        uint4 loaded[U][words];
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * Lanes;
            if (p >= parts) break;
            PEBBLE_UNROLL
            for (int k = 0; k < words; k++) loaded[u][k] = load_16(w + (int64_t(p) * words + k) * 16);
        }
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * Lanes;
            if (p >= parts) break;
            PEBBLE_UNROLL
            for (int i = 0; i < dense_part; i++) {
                const float weight = dense_value<T>(loaded[u], i);
                const int at = staged_at<2>(p * dense_part + i);
                PEBBLE_UNROLL
                for (int v = 0; v < NV; v++) acc[v] += weight * half_to_float(xs[v][at]);
            }
        }
    }
}

#ifndef PEBBLE_HOST_BUILD
// Both kernels' work (matvec_kernel, matvec_dense_kernel): Dense, the parts of dense_parts (F16, BF16, F32
// only); else T::decode's parts, a part's loads after the previous part's sums.
template <typename T, int NV, bool Dense>
__device__ inline void matvec_rows(const stacked_rows & m, int64_t n_cols, const uint16_t * __restrict__ x) {
    const int64_t n_rows = m.first[m.n];
    constexpr int part_elements = T::block_elements / T::parts;
    static_assert(matvec_chunk % (warp_lanes * part_elements) == 0 && matvec_chunk % T::block_elements == 0,
                  "a chunk is whole blocks and whole rounds of the warp's parts");
    __shared__ uint16_t xs[NV][matvec_chunk_padded];
    const int64_t blocks_per_row = n_cols / T::block_elements;
    const int lane = static_cast<int>(threadIdx.x), threads = warp_lanes * matvec_rows_per_block;
    const int tid = static_cast<int>(threadIdx.y) * warp_lanes + lane;
    for (int64_t base = int64_t(blockIdx.x) * matvec_rows_per_block; base < n_rows;
         base += int64_t(gridDim.x) * matvec_rows_per_block) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < n_rows; // the block's other warps still stage x and meet at the barriers
        float acc[NV] = {};
        for (int64_t c0 = 0; c0 < n_cols; c0 += matvec_chunk) {
            const int n = static_cast<int>(n_cols - c0 < matvec_chunk ? n_cols - c0 : matvec_chunk);
            __syncthreads(); // every warp is done with the last chunk
            PEBBLE_UNROLL
            for (int v = 0; v < NV; v++) {
                for (int e = tid; e < n; e += threads) xs[v][staged_at<2>(e)] = x[v * n_cols + c0 + e];
            }
            __syncthreads();
            if (!active) continue;
            const uint8_t * w_row = locate(m, row, blocks_per_row * T::block_bytes).w_row;
            if constexpr (Dense) {
                dense_parts<T, NV>(w_row, c0, n, lane, xs, acc);
                continue;
            }
            const int64_t p_end = (c0 + n) / part_elements;
#pragma unroll matvec_unroll
            for (int64_t p = c0 / part_elements + lane; p < p_end; p += warp_lanes) {
                const int64_t block = p / T::parts;
                const int first = static_cast<int>(block * T::block_elements - c0); // the block's element 0 in xs
                auto emit = [&](int i, float weight) {
                    const int at = staged_at<2>(first + i);
                    PEBBLE_UNROLL
                    for (int v = 0; v < NV; v++) acc[v] += weight * half_to_float(xs[v][at]);
                };
                T::decode(w_row + block * T::block_bytes, static_cast<int>(p % T::parts), emit);
            }
        }
        if (active) {
            const stacked_row at = locate(m, row, blocks_per_row * T::block_bytes);
            store_row_sums(acc, lane, at.y, at.rows, at.row);
        }
    }
}

// T::decode's parts at the registers the compiler picks (40 for most: three blocks a multiprocessor).
template <typename T, int NV>
__global__ void __launch_bounds__(warp_lanes * matvec_rows_per_block)
matvec_kernel(const __grid_constant__ stacked_rows m, int64_t n_cols, const uint16_t * __restrict__ x) {
    matvec_rows<T, NV, false>(m, n_cols, x);
}

// dense_parts at two blocks a multiprocessor (64 registers a thread, which its two parts in flight stay
// within; with no bound they took up to 128, and one block).
template <typename T, int NV>
__global__ void __launch_bounds__(warp_lanes * matvec_rows_per_block, 2)
matvec_dense_kernel(const __grid_constant__ stacked_rows m, int64_t n_cols, const uint16_t * __restrict__ x) {
    matvec_rows<T, NV, true>(m, n_cols, x);
}
#endif

// Every quantized type through 8-bit x and integer dot products (dp4a: four byte products and their sum
// in one instruction), where matvec_kernel decodes each weight to float and multiplies it by x's fp16 value
// (I2FP, HADD2, two FFMAs and its shared-memory address for every weight and vector: 0.9 TB/s for Q4_K
// and 1 TB/s for Q6_K on an H200, a quarter of its copy rate). x is quantized as the host library
// quantizes it (cpu/quantize.cc quantize_block: d = max|x| / 127, q = round-half-even(x / d); a block with
// an infinity or NaN d = NaN and q = 0), per 256 elements for the K-quants and per 32 for the others,
// while a chunk is staged, with each 16 elements' sum of q; then a lane's part of a block (64 weights, or
// a block of 32) is d_x times an exact integer sum over its groups, scaled in float once a group (Q4_K,
// Q5_K: d sc dot - dmin m sum) or once a part (Q6_K: d times sum of sc (dot - 32 sum); Q8_0: d dot; Q4_0:
// d (dot - 8 sum); Q5_0: d (dot - 16 sum); Q4_1, Q5_1: d dot + m sum). Lanes take parts as matvec_kernel's
// do; each vector's sums are its own, whatever the vectors beside it.
//
// A lane's loop over its parts (q8_lane_parts) and the loads and sums of a part are __host__ __device__:
// with PEBBLING_SIMD=gpu the host library's pebble_matvec runs them for each of 32 lanes (host_q8_matvec
// below), so that CI checks this code for every type without a GPU. The staging of x (stage_q8) and the
// kernel's loop over rows and chunks are the GPU's alone.
#ifndef PEBBLE_HOST_BUILD
constexpr int q8_chunk_bytes(int chunk) { return chunk + 4 * (chunk / 64); } // a word of padding every 64 (banks)

template <int NV, int QB> struct q8_stage { // QB: the elements of one d (256 for the K-quants, else 32)
    int8_t q[NV][q8_chunk_bytes(q8_chunk<NV>)]; // x's q, element e of the chunk at staged_at<1>(e)
    float d[NV][q8_chunk<NV> / QB];             // each QB's d
    int32_t sum[NV][q8_chunk<NV> / 16];         // each 16's sum of q
};

// Vector v's elements [c0, c0 + n) of x (fp16, n a multiple of QB) into st, a warp 256 elements, eight a
// lane, QB / 8 lanes a d; every warp of the thread block takes part, and every lane of a warp in its
// shuffles (past n, a whole d's lanes read nothing and store nothing).
template <int NV, int QB>
__device__ void stage_q8(const uint16_t * __restrict__ x, int64_t n_cols, int64_t c0, int n, q8_stage<NV, QB> & st) {
    static_assert(QB == 32 || QB == 256, "the host library's two block sizes");
    const int lane = static_cast<int>(threadIdx.x), blocks = (n + 255) / 256;
    for (int vb = static_cast<int>(threadIdx.y); vb < NV * blocks; vb += static_cast<int>(blockDim.y)) {
        const int v = vb / blocks, b = vb % blocks, e = 256 * b + 8 * lane;
        const bool here = e < n;
        const uint4 raw = here ? *reinterpret_cast<const uint4 *>(x + v * n_cols + c0 + e) : make_uint4(0, 0, 0, 0);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        float f[8], amax = 0.0f;
        bool finite = true;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            f[k] = half_to_float(static_cast<uint16_t>(words[k / 2] >> (16 * (k % 2))));
            finite = finite && isfinite(f[k]);
            amax = fmaxf(amax, fabsf(f[k]));
        }
        int all_finite = finite;
        PEBBLE_UNROLL
        for (int o = 1; o < QB / 8; o <<= 1) { // over the lanes of one d
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            all_finite &= __shfl_xor_sync(0xffffffffu, all_finite, o);
        }
        finite = all_finite != 0;
        const float d = finite ? amax / 127.0f : NAN, id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        uint32_t packed[2] = {0, 0};
        int sum = 0;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            const int q = finite ? __float2int_rn(f[k] * id) : 0;
            sum += q;
            packed[k / 4] |= (static_cast<uint32_t>(q) & 0xffu) << (8 * (k % 4));
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1); // two lanes a 16-element group
        if (!here) continue;
        int32_t * to = reinterpret_cast<int32_t *>(&st.q[v][staged_at<1>(e)]); // 8 bytes within a padding group
        to[0] = static_cast<int32_t>(packed[0]);
        to[1] = static_cast<int32_t>(packed[1]);
        if (lane % 2 == 0) st.sum[v][e / 16] = sum;
        if (lane % (QB / 8) == 0) st.d[v][e / QB] = d;
    }
}
#endif

// The scale bytes of a Q4_K or Q5_K block (its bytes 4..15) as loaded with its first 16 (head), read from
// the registers (a byte array indexed by the run-time sub-block would be local memory).
struct scale_bytes {
    uint4 head;
    __host__ __device__ uint32_t operator[](int i) const {
        const uint32_t word = i < 4 ? head.y : i < 8 ? head.z : head.w;
        return (word >> (8 * (i & 3))) & 0xffu;
    }
};

// A lane's part of a block, loaded: the weight bytes it reads, in registers, so that the loads of a lane's
// next parts go out before the first is used (as one loop, each part's loads waited for the part before it
// to be summed: one part's bytes in flight a lane, under half the copy rate's).
template <typename T> struct k_bytes { uint4 head, lo, hi; };                  // Q4_K: d, dmin, scales; 32 nibble bytes
template <> struct k_bytes<type_q5_k> { uint4 head, lo, hi, qh_lo, qh_hi; }; // and Q5_K's 32 bytes of fifth bits
struct q6_k_bytes { uint32_t ql[8], qh[8]; int sc[4]; uint16_t d; };
template <int N> struct block32_bytes { uint32_t qs[N / 4], qh; uint16_t d, m; }; // qh, m where the type has them

// Part `part` of Q4_K or Q5_K block bb: sub-blocks 2 part (the low nibbles of 32 bytes) and 2 part + 1
// (their high nibbles), and for Q5_K the 32 bytes of fifth bits, in 16-byte loads (the blocks are 144 and
// 176 bytes, so a 16-byte aligned matrix has every block aligned).
template <typename T>
__host__ __device__ inline k_bytes<T> k_load(const uint8_t * __restrict__ bb, int part) {
    if constexpr (T::id == type_q5_k::id) {
        return {load_16(bb), load_16(bb + 48 + 32 * part), load_16(bb + 64 + 32 * part), load_16(bb + 16),
                load_16(bb + 32)};
    } else {
        return {load_16(bb), load_16(bb + 16 + 32 * part), load_16(bb + 32 + 32 * part)};
    }
}

// That part's products with x, whose element 0 is element `first` of the staging st.
template <typename T, int NV, typename Stage>
__host__ __device__ void k_part(const k_bytes<T> & w, int part, int first, const Stage & st, float (&acc)[NV]) {
    const uint4 head = w.head, lo = w.lo, hi = w.hi;
    const float d = half_to_float(static_cast<uint16_t>(head.x)), dmin = half_to_float(static_cast<uint16_t>(head.x >> 16));
    const scale_bytes scales{head};
    int sc_a, m_a, sc_b, m_b;
    type_q4_k::scale_min(scales, 2 * part, sc_a, m_a);
    type_q4_k::scale_min(scales, 2 * part + 1, sc_b, m_b);
    const float d_a = d * static_cast<float>(sc_a), d_b = d * static_cast<float>(sc_b);
    const float min_a = dmin * static_cast<float>(m_a), min_b = dmin * static_cast<float>(m_b);
    const uint32_t qs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint32_t q_a[8], q_b[8]; // sub-block A's and B's q, four a word: a nibble, and Q5_K's fifth bit above it
    PEBBLE_UNROLL
    for (int k = 0; k < 8; k++) {
        q_a[k] = qs[k] & 0x0f0f0f0fu;
        q_b[k] = (qs[k] >> 4) & 0x0f0f0f0fu;
    }
    if constexpr (T::id == type_q5_k::id) { // element l's fifth bits are bits 2 part, 2 part + 1 of byte l
        const uint32_t qh[8] = {w.qh_lo.x, w.qh_lo.y, w.qh_lo.z, w.qh_lo.w, w.qh_hi.x, w.qh_hi.y, w.qh_hi.z, w.qh_hi.w};
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            q_a[k] |= ((qh[k] >> (2 * part)) & 0x01010101u) << 4;
            q_b[k] |= ((qh[k] >> (2 * part + 1)) & 0x01010101u) << 4;
        }
    }
    const int local = first + 64 * part, g = local / 16;
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xa = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(local)]); // A's 32, then B's
        int dot_a = 0, dot_b = 0;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            dot_a = dot4(static_cast<int>(q_a[k]), xa[k], dot_a);
            dot_b = dot4(static_cast<int>(q_b[k]), xa[8 + k], dot_b);
        }
        const int sum_a = st.sum[v][g] + st.sum[v][g + 1], sum_b = st.sum[v][g + 2] + st.sum[v][g + 3];
        acc[v] += st.d[v][local / 256] * (d_a * static_cast<float>(dot_a) + d_b * static_cast<float>(dot_b)
                                          - min_a * static_cast<float>(sum_a) - min_b * static_cast<float>(sum_b));
    }
}

// Part `part` of Q6_K block bb (type_q6_k: half h = part / 2, quarters j = part % 2 and j + 2, which
// share 32 bytes of ql; 32 bytes of qh; a scale a 16 elements). A block is 210 bytes: its loads are as
// aligned as it is.
__host__ __device__ inline q6_k_bytes q6_k_load(const uint8_t * __restrict__ bb, int part) {
    const int h = part >> 1, j = part & 1;
    q6_k_bytes w;
    load_words<32>(w.ql, bb + 64 * h + 32 * j);
    load_words<32>(w.qh, bb + 128 + 32 * h);
    const int8_t * sc = reinterpret_cast<const int8_t *>(bb + 192 + 8 * h + 2 * j); // lo 0, 1; hi 4, 5
    w.sc[0] = sc[0];
    w.sc[1] = sc[1];
    w.sc[2] = sc[4];
    w.sc[3] = sc[5];
    w.d = load_u16(bb + 208);
    return w;
}

// That part's products with x: q - 32 as (dot - 32 sum) in integers, each 16's times its scale, summed
// exactly.
template <int NV, typename Stage>
__host__ __device__ void q6_k_part(const q6_k_bytes & w, int part, int first, const Stage & st, float (&acc)[NV]) {
    const int h = part >> 1, j = part & 1;
    const int sc_lo0 = w.sc[0], sc_lo1 = w.sc[1], sc_hi0 = w.sc[2], sc_hi1 = w.sc[3];
    const float d = half_to_float(w.d);
    uint32_t q_lo[8], q_hi[8];
    PEBBLE_UNROLL
    for (int k = 0; k < 8; k++) {
        q_lo[k] = (w.ql[k] & 0x0f0f0f0fu) | (((w.qh[k] >> (2 * j)) & 0x03030303u) << 4);
        q_hi[k] = ((w.ql[k] >> 4) & 0x0f0f0f0fu) | (((w.qh[k] >> (2 * j + 4)) & 0x03030303u) << 4);
    }
    const int lo_first = first + 128 * h + 32 * j, hi_first = lo_first + 64; // quarters j and j + 2
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xl = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(lo_first)]);
        const int32_t * xh = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(hi_first)]);
        int dot[4] = {0, 0, 0, 0}; // lo 0..15, lo 16..31, hi 0..15, hi 16..31
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            dot[k / 4] = dot4(static_cast<int>(q_lo[k]), xl[k], dot[k / 4]);
            dot[2 + k / 4] = dot4(static_cast<int>(q_hi[k]), xh[k], dot[2 + k / 4]);
        }
        const int32_t * sl = &st.sum[v][lo_first / 16], * sh = &st.sum[v][hi_first / 16];
        const int total = sc_lo0 * (dot[0] - 32 * sl[0]) + sc_lo1 * (dot[1] - 32 * sl[1])
                          + sc_hi0 * (dot[2] - 32 * sh[0]) + sc_hi1 * (dot[3] - 32 * sh[1]);
        acc[v] += st.d[v][first / 256] * (d * static_cast<float>(total));
    }
}

// A block of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) whose element 0 is element `first` of the staging, x
// quantized per 32 as the host quantizes it for these types. Q8_0: an fp16 d, 32 int8 weights. The others:
// fp16 d (and m for Q4_1 and Q5_1), the 32 fifth bits of Q5_0 and Q5_1 (element i's in bit i), then 16
// bytes of nibbles, element i's low in byte i and element 16 + i's high. Values d q (Q8_0), d (q - 8)
// (Q4_0), d (q - 16) (Q5_0), d q + m (Q4_1, Q5_1).
template <typename T> using block32_of = block32_bytes<T::id == type_q8_0::id ? 32 : 16>;
template <typename T> constexpr bool has_min = T::id == type_q4_1::id || T::id == type_q5_1::id;
template <typename T> constexpr bool has_fifth_bits = T::id == type_q5_0::id || T::id == type_q5_1::id;

template <typename T>
__host__ __device__ inline block32_of<T> block32_load(const uint8_t * __restrict__ bb) {
    constexpr int qs_at = 2 + (has_min<T> ? 2 : 0) + (has_fifth_bits<T> ? 4 : 0);
    block32_of<T> w;
    load_words<T::id == type_q8_0::id ? 32 : 16>(w.qs, bb + qs_at);
    w.d = load_u16(bb);
    w.m = has_min<T> ? load_u16(bb + 2) : 0;
    w.qh = has_fifth_bits<T> ? load_high_bits(bb + (has_min<T> ? 4 : 2)) : 0;
    return w;
}

// Bits 4k .. 4k + 3 of qh (the fifth bits of elements 4k .. 4k + 3) as bit 4 of bytes 0..3.
__host__ __device__ inline uint32_t fifth_bits(uint32_t qh, int k) {
    const uint32_t b = (qh >> (4 * k)) & 0xfu;
    return (b & 1u) << 4 | (b & 2u) << 11 | (b & 4u) << 18 | (b & 8u) << 25;
}

template <typename T, int NV, typename Stage>
__host__ __device__ void block32(const block32_of<T> & w, int first, const Stage & st, float (&acc)[NV]) {
    constexpr bool q8 = T::id == type_q8_0::id;
    constexpr int offset = T::id == type_q4_0::id ? 8 : T::id == type_q5_0::id ? 16 : 0; // subtracted from q
    const float d = half_to_float(w.d), m = half_to_float(w.m);
    uint32_t q[8]; // element 4k .. 4k + 3's q in word k
    PEBBLE_UNROLL
    for (int k = 0; k < 8; k++) {
        q[k] = q8 ? w.qs[k] : (w.qs[k % 4] >> (4 * (k / 4))) & 0x0f0f0f0fu; // nibbles: low, then high
        if (has_fifth_bits<T>) q[k] |= fifth_bits(w.qh, k);
    }
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xw = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(first)]);
        int dot = 0;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) dot = dot4(static_cast<int>(q[k]), xw[k], dot);
        const int sum = q8 ? 0 : st.sum[v][first / 16] + st.sum[v][first / 16 + 1];
        const float part = has_min<T> ? d * static_cast<float>(dot) + m * static_cast<float>(sum)
                                      : d * static_cast<float>(dot - offset * sum);
        acc[v] += st.d[v][first / 32] * part;
    }
}

// A lane's part `part` of block bb of type T, loaded; and its products with x.
template <typename T> constexpr bool k45 = T::id == type_q4_k::id || T::id == type_q5_k::id;
template <typename T> struct part_bytes_of { using type = block32_of<T>; };
template <> struct part_bytes_of<type_q4_k> { using type = k_bytes<type_q4_k>; };
template <> struct part_bytes_of<type_q5_k> { using type = k_bytes<type_q5_k>; };
template <> struct part_bytes_of<type_q6_k> { using type = q6_k_bytes; };

template <typename T>
__host__ __device__ inline typename part_bytes_of<T>::type load_part(const uint8_t * __restrict__ bb, int part) {
    if constexpr (k45<T>) {
        return k_load<T>(bb, part);
    } else if constexpr (T::id == type_q6_k::id) {
        return q6_k_load(bb, part);
    } else {
        return block32_load<T>(bb);
    }
}

template <typename T, int NV, typename Stage>
__host__ __device__ inline void sum_part(const typename part_bytes_of<T>::type & w, int part, int first,
                                         const Stage & st, float (&acc)[NV]) {
    if constexpr (k45<T>) {
        k_part<T, NV>(w, part, first, st, acc);
    } else if constexpr (T::id == type_q6_k::id) {
        q6_k_part<NV>(w, part, first, st, acc);
    } else {
        block32<T, NV>(w, first, st, acc);
    }
}

// Lane `lane` (of Lanes)'s parts of the chunk [c0, c0 + n) of the warp's WR rows (w_row, where active),
// x staged in st from element c0, in groups of U: every load of a group goes out before its first part is
// summed, parts and rows summed in the order of one part at a time (the same sums, bit for bit). (On the
// host, for PEBBLING_SIMD=gpu, each of 32 lanes in turn: host_q8_matvec.)
template <typename T, int NV, int WR, int Lanes = warp_lanes, typename Stage>
__host__ __device__ inline void q8_lane_parts(const uint8_t * const (&w_row)[WR], const bool (&active)[WR], int64_t c0,
                                              int n, int lane, const Stage & st, float (&acc)[WR][NV]) {
    constexpr int part_elements = T::block_elements / T::parts, U = part_loads<WR>;
    const int64_t p_end = (c0 + n) / part_elements;
    for (int64_t p0 = c0 / part_elements + lane; p0 < p_end; p0 += int64_t(U) * Lanes) {
        typename part_bytes_of<T>::type w[U][WR];
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int64_t p = p0 + int64_t(u) * Lanes;
            if (p >= p_end) break;
            PEBBLE_UNROLL
            for (int r = 0; r < WR; r++) {
                if (active[r]) w[u][r] = load_part<T>(w_row[r] + p / T::parts * T::block_bytes,
                                                      static_cast<int>(p % T::parts));
            }
        }
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int64_t p = p0 + int64_t(u) * Lanes;
            if (p >= p_end) break;
            const int64_t block = p / T::parts;
            const int first = static_cast<int>(block * T::block_elements - c0), part = static_cast<int>(p % T::parts);
            PEBBLE_UNROLL
            for (int r = 0; r < WR; r++) {
                if (active[r]) sum_part<T, NV>(w[u][r], part, first, st, acc[r]);
            }
        }
    }
}

#ifndef PEBBLE_HOST_BUILD
// Two blocks a multiprocessor (64 registers a thread): without the bound, a lane's two parts in registers
// took 72 to 127 and one block, which halved the warps and undid the loads' gain; with it none spills.
template <typename T, int NV, int WR>
__global__ void __launch_bounds__(warp_lanes * matvec_rows_per_block, 2)
matvec_q8_kernel(const __grid_constant__ stacked_rows m, int64_t n_cols, const uint16_t * __restrict__ x, bool whole) {
    const int64_t n_rows = m.first[m.n];
    constexpr bool k_quant = T::block_elements == 256;
    constexpr int part_elements = T::block_elements / T::parts; // 64 for the K-quants, else a block of 32
    static_assert(part_elements == (k_quant ? 64 : 32), "the parts this kernel reads");
    __shared__ __align__(16) q8_stage<NV, k_quant ? 256 : 32> st;
    const int64_t blocks_per_row = n_cols / T::block_elements;
    const int lane = static_cast<int>(threadIdx.x);
    // whole (a row that fits one chunk, unless PEBBLING_CUDA_PERSIST=0): x staged once, then every row the
    // block takes read without a barrier (the launcher gives such a product only the blocks the GPU holds
    // at once, so each stages once).
    constexpr int chunk = q8_chunk<NV>;
    if (whole) {
        stage_q8<NV>(x, n_cols, 0, static_cast<int>(n_cols), st);
        __syncthreads();
    }
    // A warp takes WR rows at once, row r of them warps_per_block apart, so that the loads of their parts
    // are in flight together (see warp_rows).
    constexpr int64_t block_rows = int64_t(matvec_rows_per_block) * WR;
    for (int64_t base = int64_t(blockIdx.x) * block_rows; base < n_rows; base += int64_t(gridDim.x) * block_rows) {
        int64_t row[WR];
        bool active[WR]; // the same for the warp's lanes; the block's other warps still meet at the barriers
        float acc[WR][NV] = {};
        PEBBLE_UNROLL
        for (int r = 0; r < WR; r++) {
            row[r] = base + int64_t(r) * matvec_rows_per_block + threadIdx.y;
            active[r] = row[r] < n_rows;
        }
        for (int64_t c0 = 0; c0 < n_cols; c0 += chunk) {
            const int n = static_cast<int>(n_cols - c0 < chunk ? n_cols - c0 : chunk);
            if (!whole) {
                __syncthreads(); // every warp is done with the last chunk
                stage_q8<NV>(x, n_cols, c0, n, st);
                __syncthreads();
            }
            if (!active[0]) continue; // row 0 is the warp's first: none of its rows are
            const uint8_t * w_row[WR];
            PEBBLE_UNROLL
            for (int r = 0; r < WR; r++) {
                w_row[r] = active[r] ? locate(m, row[r], blocks_per_row * T::block_bytes).w_row : nullptr;
            }
            q8_lane_parts<T, NV, WR>(w_row, active, c0, n, lane, st, acc);
        }
        PEBBLE_UNROLL
        for (int r = 0; r < WR; r++) {
            if (!active[r]) continue;
            const stacked_row at = locate(m, row[r], blocks_per_row * T::block_bytes);
            store_row_sums(acc[r], lane, at.y, at.rows, at.row);
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------------
// launchers

#ifdef PEBBLE_HOST_BUILD
// f(begin, end) over [0, n), on the host's thread pool when there is enough work (`work` elements) to
// pay for waking it (cpu/pool.cc). The shares are disjoint, so the results are those of one thread.
template <typename F>
void host_parallel(int64_t n, int64_t work, F && f) {
    pebble_cpu::parallel_for(n, work, f);
}
#endif


// GGUF type names, for messages (ids without a type are left empty).
const char * type_name(int32_t ggml_type) {
    static const char * const names[PEBBLE_TYPE_COUNT] = {
        "F32", "F16", "Q4_0", "Q4_1", nullptr, nullptr, "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K",
        "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",
        "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", nullptr, nullptr, nullptr,
        "TQ1_0", "TQ2_0", nullptr, nullptr, nullptr, "MXFP4", "NVFP4", "Q1_0",
    };
    const char * name = ggml_type >= 0 && ggml_type < PEBBLE_TYPE_COUNT ? names[ggml_type] : nullptr;
    return name ? name : "?";
}

#define SUPPORTED_TYPES "0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, 30 BF16"

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

#ifndef PEBBLE_HOST_BUILD
// A kernel reading pageable host memory would fault, and a fault ends the whole CUDA context.
pebble_status check_reachable(const void * ptr, const char * what, const char * fn, int32_t ggml_type) {
    cudaPointerAttributes attr = {};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        cudaGetLastError(); // clear the error the runtime keeps for the next call
        attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type == cudaMemoryTypeUnregistered) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: %s (%p) is pageable host memory; the cuda library's "
                    "kernels need device, managed or pinned host memory", fn, type_name(ggml_type), what, ptr);
    }
    return PEBBLE_OK;
}

pebble_status check_launch(const char * fn, int32_t ggml_type) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        return fail(PEBBLE_ERR_CUDA, "%s: %s: the kernel could not be launched: %s", fn, type_name(ggml_type),
                    cudaGetErrorString(err));
    }
    return PEBBLE_OK;
}
#endif

template <typename T>
pebble_status launch_dequantize(const uint8_t * src, uint16_t * dst, int64_t n_blocks, cudaStream_t stream) {
    if constexpr (T::id == type_f16::id) { // already fp16: a copy keeps every bit, NaN payloads included
        CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n_blocks) * T::block_bytes, cudaMemcpyDefault,
                                   stream));
        return PEBBLE_OK;
    }
    const int64_t n_parts = n_blocks * T::parts;
#ifdef PEBBLE_HOST_BUILD
    (void)n_parts;
    host_parallel(n_blocks, n_blocks * T::block_elements, [=](int64_t begin, int64_t end) {
        dequantize_kernel<T>(src + begin * T::block_bytes, dst + begin * T::block_elements, (end - begin) * T::parts);
    });
    return PEBBLE_OK;
#else
    const int64_t grid = std::min(max_grid, (n_parts + dequantize_threads - 1) / dequantize_threads);
    if constexpr (T::block_elements / T::parts >= 32) {
        if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) { // it stores 4-byte words
            dequantize_tiled_kernel<T><<<static_cast<unsigned>(grid), dequantize_threads, 0, stream>>>(src, dst, n_parts);
            return check_launch("pebble_dequantize", T::id);
        }
    }
    dequantize_kernel<T><<<static_cast<unsigned>(grid), dequantize_threads, 0, stream>>>(src, dst, n_parts);
    return check_launch("pebble_dequantize", T::id);
#endif
}


// f(std::integral_constant<int, n_vec>{}) for n_vec in 1..8: the number of vectors is a template argument,
// so that each lane's sums stay in registers.
template <typename F> pebble_status with_vectors(int32_t n_vec, F && f) {
    static_assert(PEBBLE_MATVEC_MAX_VEC == 8, "one case per vector count");
    switch (n_vec) {
        case 1: return f(std::integral_constant<int, 1>{});
        case 2: return f(std::integral_constant<int, 2>{});
        case 3: return f(std::integral_constant<int, 3>{});
        case 4: return f(std::integral_constant<int, 4>{});
        case 5: return f(std::integral_constant<int, 5>{});
        case 6: return f(std::integral_constant<int, 6>{});
        case 7: return f(std::integral_constant<int, 7>{});
        case 8: return f(std::integral_constant<int, 8>{});
    }
    return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_matvec: n_vec %d is outside 1..%d", n_vec, PEBBLE_MATVEC_MAX_VEC);
}

#ifndef PEBBLE_HOST_BUILD
// The stack's matrices' addresses or'ed together: their low bits say whether every one is 16-byte aligned.
uintptr_t stack_addresses(const stacked_rows & m) {
    uintptr_t bits = 0;
    for (int32_t p = 0; p < m.n; p++) bits |= reinterpret_cast<uintptr_t>(m.w[p]);
    return bits;
}

template <typename T, int NV>
pebble_status launch_stacked_n(const stacked_rows & m, int64_t n_cols, const uint16_t * x, cudaStream_t stream) {
    const int64_t n_rows = m.first[m.n];
    const int64_t grid = std::min(max_grid, (n_rows + matvec_rows_per_block - 1) / matvec_rows_per_block);
    const dim3 block(warp_lanes, matvec_rows_per_block);
    if constexpr (T::block_elements > 1) { // every quantized type; 16-byte loads of x (and Q4_K's and Q5_K's weights)
        const uintptr_t aligned = reinterpret_cast<uintptr_t>(x) | (k45<T> ? stack_addresses(m) : 0);
        if ((aligned & 15) == 0 && switches().integer_matvec) {
            static const int64_t held = resident_blocks(matvec_q8_kernel<T, NV, 1>, warp_lanes * matvec_rows_per_block);
            const bool whole = switches().persist && n_cols <= q8_chunk<NV>;
            if constexpr (warp_rows<NV> > 1) { // only where the row groups outnumber the blocks the GPU holds:
                if (grid > held) {             // fewer blocks would leave multiprocessors idle
                    constexpr int64_t rows_a_block = int64_t(matvec_rows_per_block) * warp_rows<NV>;
                    static const int64_t held_wide =
                        resident_blocks(matvec_q8_kernel<T, NV, warp_rows<NV>>, warp_lanes * matvec_rows_per_block);
                    const int64_t wide_grid = std::min(max_grid, (n_rows + rows_a_block - 1) / rows_a_block);
                    const int64_t blocks = whole ? std::min(wide_grid, held_wide) : wide_grid;
                    matvec_q8_kernel<T, NV, warp_rows<NV>>
                        <<<static_cast<unsigned>(blocks), block, 0, stream>>>(m, n_cols, x, whole);
                    return check_launch("pebble_matvec", T::id);
                }
            }
            const int64_t blocks = whole ? std::min(grid, held) : grid;
            matvec_q8_kernel<T, NV, 1><<<static_cast<unsigned>(blocks), block, 0, stream>>>(m, n_cols, x, whole);
            return check_launch("pebble_matvec", T::id);
        }
    }
    if constexpr (T::id == type_f16::id || T::id == type_bf16::id || T::id == type_f32::id) {
        if ((stack_addresses(m) & 15) == 0 && n_cols % dense_part == 0 && switches().dense) {
            matvec_dense_kernel<T, NV><<<static_cast<unsigned>(grid), block, 0, stream>>>(m, n_cols, x);
            return check_launch("pebble_matvec", T::id);
        }
    }
    matvec_kernel<T, NV><<<static_cast<unsigned>(grid), block, 0, stream>>>(m, n_cols, x);
    return check_launch("pebble_matvec", T::id);
}

template <typename T>
pebble_status launch_stacked(const stacked_rows & m, int64_t n_cols, const uint16_t * x, int32_t n_vec,
                             cudaStream_t stream) {
    return with_vectors(n_vec, [&](auto nv) { return launch_stacked_n<T, decltype(nv)::value>(m, n_cols, x, stream); });
}

stacked_rows one_matrix(const uint8_t * w, int64_t n_rows, float * y) {
    stacked_rows m = {};
    m.w[0] = w;
    m.y[0] = y;
    m.first[1] = n_rows;
    m.n = 1;
    return m;
}
#endif

#ifdef PEBBLE_HOST_BUILD
// The staging of a row of x for host_q8_matvec, indexed as the GPU's q8_stage is (q at staged_at<1>); `from`
// gives the view of the stretch from element c0 on (a multiple of 256), as a chunk's staging is indexed.
template <int NV> struct host_q8_stage {
    const int8_t *  q[NV];
    const float *   d[NV];
    const int32_t * sum[NV];

    host_q8_stage from(int64_t c0, int qb) const {
        host_q8_stage view = *this;
        for (int v = 0; v < NV; v++) {
            view.q[v] += staged_at<1>(static_cast<int>(c0));
            view.d[v] += c0 / qb;
            view.sum[v] += c0 / 16;
        }
        return view;
    }
};

// The 32 lanes' sums of a row added as __shfl_xor_sync's butterfly adds them (warp_sum), into y's row r.
template <int NV> void host_warp_sums(float (&lanes)[32][NV], float * y, int64_t n_rows, int64_t r) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        float next[32][NV];
        for (int l = 0; l < 32; l++) {
            for (int v = 0; v < NV; v++) next[l][v] = lanes[l][v] + lanes[l ^ offset][v];
        }
        memcpy(lanes, next, sizeof lanes);
    }
    for (int v = 0; v < NV; v++) y[v * n_rows + r] = lanes[0][v];
}

// PEBBLING_SIMD=gpu: y = W x as the GPU's integer kernel computes it (one row a warp: warp_rows 1), a row
// at a time (rows among the pool's threads): x quantized per QB elements (pebble_cpu's quantization, which
// the GPU's stage_q8 repeats) with each 16's sum of q, then for each of the kernel's chunks of x each of 32
// lanes in turn through the kernel's own q8_lane_parts, and the lanes' sums added as the GPU's shuffles
// add them. Only the fused multiply-adds the GPU's compiler makes differ from the GPU's sums.
template <typename T, int NV>
pebble_status host_q8_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, float * y) {
    constexpr int QB = T::block_elements == 256 ? 256 : 32;
    if (n_cols > (int64_t(1) << 30)) { // staged_at's int offsets, as the GPU's shared memory's
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_matvec: %s: n_cols %" PRId64 " is past the 2^30 columns "
                    "PEBBLING_SIMD=gpu stages; unset it for the host's kernels", type_name(T::id), n_cols);
    }
    const int64_t staged = staged_at<1>(static_cast<int>(n_cols)) + 4, blocks = n_cols / QB;
    std::unique_ptr<int32_t[]> q_words(new (std::nothrow) int32_t[NV * staged / 4 + 1]);
    std::unique_ptr<float[]> d(new (std::nothrow) float[NV * blocks]);
    std::unique_ptr<int32_t[]> sums(new (std::nothrow) int32_t[NV * (n_cols / 16)]);
    if (!q_words || !d || !sums) {
        return fail(PEBBLE_ERR_HOST_OOM, "pebble_matvec: %s: no host memory to stage x (%" PRId64 " columns)",
                    type_name(T::id), n_cols);
    }
    int8_t * q = reinterpret_cast<int8_t *>(q_words.get());
    host_q8_stage<NV> st;
    for (int v = 0; v < NV; v++) {
        int8_t * qv = q + v * staged;
        for (int64_t b = 0; b < blocks; b++) {
            int8_t block[256];
            pebble_cpu::quantize(x + v * n_cols + b * QB, QB, d[v * blocks + b], block);
            for (int i = 0; i < QB; i++) qv[staged_at<1>(static_cast<int>(b * QB + i))] = block[i];
            for (int g = 0; g < QB / 16; g++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += block[16 * g + i];
                sums[v * (n_cols / 16) + b * QB / 16 + g] = s;
            }
        }
        st.q[v] = qv;
        st.d[v] = d.get() + v * blocks;
        st.sum[v] = sums.get() + v * (n_cols / 16);
    }
    const int64_t row_bytes = n_cols / T::block_elements * T::block_bytes;
    constexpr int chunk = q8_chunk<NV>;
    host_parallel(n_rows, n_rows * n_cols * NV, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
            float lanes[32][NV] = {};
            const uint8_t * const w_row[1] = {w + r * row_bytes};
            const bool active[1] = {true};
            for (int64_t c0 = 0; c0 < n_cols; c0 += chunk) {
                const int n = static_cast<int>(std::min<int64_t>(chunk, n_cols - c0));
                const host_q8_stage<NV> view = st.from(c0, QB);
                for (int lane = 0; lane < 32; lane++) {
                    float acc[1][NV];
                    memcpy(acc[0], lanes[lane], sizeof acc);
                    q8_lane_parts<T, NV, 1, 32>(w_row, active, c0, n, lane, view, acc);
                    memcpy(lanes[lane], acc[0], sizeof acc);
                }
            }
            host_warp_sums(lanes, y, n_rows, r);
        }
    });
    return PEBBLE_OK;
}

// PEBBLING_SIMD=gpu for F16, BF16 and F32 rows of whole 8-element parts: y = W x as the GPU's dense kernel
// computes it, x staged in fp16 a chunk of matvec_chunk at a time as the kernel stages it, each of 32 lanes
// in turn through the kernel's own dense_parts, and the lanes' sums added as the GPU's shuffles add them.
template <typename T, int NV>
pebble_status host_dense_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, float * y) {
    const int64_t row_bytes = n_cols * T::block_bytes;
    host_parallel(n_rows, n_rows * n_cols * NV, [&](int64_t begin, int64_t end) {
        uint16_t xs[NV][matvec_chunk_padded]; // 34 KB at 8 vectors
        for (int64_t r = begin; r < end; r++) {
            float lanes[32][NV] = {};
            for (int64_t c0 = 0; c0 < n_cols; c0 += matvec_chunk) {
                const int n = static_cast<int>(std::min<int64_t>(matvec_chunk, n_cols - c0));
                for (int v = 0; v < NV; v++) {
                    for (int e = 0; e < n; e++) xs[v][staged_at<2>(e)] = x[v * n_cols + c0 + e];
                }
                for (int lane = 0; lane < 32; lane++) {
                    dense_parts<T, NV, 32>(w + r * row_bytes, c0, n, lane, xs, lanes[lane]);
                }
            }
            host_warp_sums(lanes, y, n_rows, r);
        }
    });
    return PEBBLE_OK;
}

// pebble_matvec, pebble_matmul and pebble_matmul_f32 with PEBBLING_SIMD=gpu, as the cuda library runs them:
// float32 x rounded to fp16 first, then host_q8_matvec (the quantized types) or host_dense_matvec (F16,
// BF16, F32 in rows of whole 8-element parts) over groups of up to 8 vectors.
template <typename T>
pebble_status host_gpu_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const void * x, bool x_f32,
                              int64_t n_vec, float * y, const char * fn) {
    TRY(pebble_cpu::check_threads(fn));
    const uint16_t * x_f16 = static_cast<const uint16_t *>(x);
    std::unique_ptr<uint16_t[]> half;
    if (x_f32) {
        half.reset(new (std::nothrow) uint16_t[n_vec * n_cols]);
        if (!half) return fail(PEBBLE_ERR_HOST_OOM, "%s: %s: no host memory for x in fp16", fn, type_name(T::id));
        const float * xf = static_cast<const float *>(x);
        for (int64_t i = 0; i < n_vec * n_cols; i++) half[i] = half_from_float(xf[i]); // to_half_kernel's
        x_f16 = half.get();
    }
    for (int64_t v = 0; v < n_vec; v += PEBBLE_MATVEC_MAX_VEC) {
        const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
        TRY(with_vectors(group, [&](auto nv) {
            constexpr int NV = decltype(nv)::value;
            if constexpr (T::block_elements > 1) {
                return host_q8_matvec<T, NV>(w, n_rows, n_cols, x_f16 + v * n_cols, y + v * n_rows);
            } else {
                return host_dense_matvec<T, NV>(w, n_rows, n_cols, x_f16 + v * n_cols, y + v * n_rows);
            }
        }));
    }
    return PEBBLE_OK;
}
#endif

template <typename T, int NV>
pebble_status launch_matvec_n(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, float * y,
                              cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream; // the host's kernels (cpu/matmul.cc): x quantized once, integer SIMD dot products
    return pebble_cpu::matmul(T::id, w, n_rows, n_cols, x, false, NV, y, "pebble_matvec");
#else
    return launch_stacked_n<T, NV>(one_matrix(w, n_rows, y), n_cols, x, stream);
#endif
}

// One matrix times n_vec (1..8) vectors.
template <typename T>
pebble_status launch_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, int32_t n_vec,
                            float * y, cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    return with_vectors(n_vec, [&](auto nv) {
        return launch_matvec_n<T, decltype(nv)::value>(w, n_rows, n_cols, x, y, stream);
    });
#else
    return launch_stacked<T>(one_matrix(w, n_rows, y), n_cols, x, n_vec, stream);
#endif
}

} // namespace

// ---------------------------------------------------------------------------------------------------
// for the library's other sources (pebble_internal.h)

namespace pebble_internal {

const char * ggml_type_name(int32_t ggml_type) { return type_name(ggml_type); }

const cuda_switches & switches() {
    static const cuda_switches read = [] {
        auto is = [](const char * name, const char * value) {
            const char * env = std::getenv(name);
            return env && std::strcmp(env, value) == 0;
        };
        cuda_switches s = {!is("PEBBLING_CUDA_MATVEC", "float"), !is("PEBBLING_CUDA_PERSIST", "0"),
                           !is("PEBBLING_CUDA_STACK", "0"), max_launch_group, !is("PEBBLING_CUDA_SPLIT", "0"),
                           !is("PEBBLING_CUDA_DENSE", "0")};
        const char * group = std::getenv("PEBBLING_CUDA_GROUP");
        if (group && group[0] >= '1' && group[0] < '1' + max_launch_group && group[1] == '\0') s.group = group[0] - '0';
        return s;
    }();
    return read;
}

bool type_block(int32_t ggml_type, int64_t * block_elements, int64_t * block_bytes) {
    return visit_type(ggml_type, [&](auto t) {
        *block_elements = decltype(t)::block_elements;
        *block_bytes    = decltype(t)::block_bytes;
    });
}

pebble_status check_matrix(const char * fn, const char * what, int32_t ggml_type, int64_t n_rows, int64_t n_cols) {
    return with_type(ggml_type, fn, [&](auto t) {
        using T = decltype(t);
        if (n_rows < 1 || n_cols < 1 || n_cols % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %s %" PRId64 " x %" PRId64 ": rows of whole %d-element "
                        "blocks are needed", fn, what, type_name(T::id), n_rows, n_cols, T::block_elements);
        }
        return PEBBLE_OK;
    });
}

pebble_status matvec_one(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const uint16_t * x,
                         float * y, cudaStream_t stream) {
    return with_type(ggml_type, "pebble_matvec", [&](auto t) {
        using T = decltype(t);
        return launch_matvec_n<T, 1>(static_cast<const uint8_t *>(w), n_rows, n_cols, x, y, stream);
    });
}

pebble_status matvec_many(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const void * x,
                          int64_t n_vec, float * y, cudaStream_t stream) {
    return with_type(ggml_type, "pebble_decoder_step", [&](auto t) {
        using T = decltype(t);
#ifdef PEBBLE_HOST_BUILD
        (void)stream;
        return pebble_cpu::matmul(T::id, static_cast<const uint8_t *>(w), n_rows, n_cols, x, true, n_vec, y,
                                  "pebble_decoder_step", true);
#else
        const uint16_t * x16 = static_cast<const uint16_t *>(x);
        for (int64_t v = 0; v < n_vec; v += PEBBLE_MATVEC_MAX_VEC) {
            const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
            TRY(launch_matvec<T>(static_cast<const uint8_t *>(w), n_rows, n_cols, x16 + v * n_cols, group,
                                 y + v * n_rows, stream));
        }
        return PEBBLE_OK;
#endif
    });
}

pebble_status matvec_parts(const matvec_part * parts, int n_parts, int64_t n_cols, const void * x, int64_t n_vec,
                           cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream;
    pebble_cpu::matmul_part cpu[pebble_cpu::max_matmul_parts];
    for (int p = 0; p < std::min(n_parts, pebble_cpu::max_matmul_parts); p++) { // matmul_parts refuses other counts
        TRY(with_type(parts[p].ggml_type, "pebble_decoder_step", [](auto) { return PEBBLE_OK; }));
        cpu[p] = {parts[p].ggml_type, static_cast<const uint8_t *>(parts[p].w), parts[p].n_rows, parts[p].y};
    }
    return pebble_cpu::matmul_parts(cpu, n_parts, n_cols, x, true, n_vec, "pebble_decoder_step", true);
#else
    const uint16_t * x16 = static_cast<const uint16_t *>(x);
    for (int p = 0; p < n_parts;) {
        int end = p + 1; // the parts of p's type that follow it: one stack
        // (and of its alignment: a part whose weights are not 16-byte aligned would take the whole stack
        // to the float kernel, which multiplies x as it is, where alone the others take the integer one)
        const int most = switches().stack ? max_stacked : 1;
        auto aligned = [&](int k) { return (reinterpret_cast<uintptr_t>(parts[k].w) & 15) == 0; };
        while (end < n_parts && end - p < most && parts[end].ggml_type == parts[p].ggml_type &&
               aligned(end) == aligned(p)) end++;
        TRY(with_type(parts[p].ggml_type, "pebble_decoder_step", [&](auto t) {
            using T = decltype(t);
            for (int64_t v = 0; v < n_vec; v += PEBBLE_MATVEC_MAX_VEC) {
                stacked_rows m = {};
                for (int k = p; k < end; k++, m.n++) {
                    m.w[m.n] = static_cast<const uint8_t *>(parts[k].w);
                    m.y[m.n] = parts[k].y + v * parts[k].n_rows;
                    m.first[m.n + 1] = m.first[m.n] + parts[k].n_rows;
                }
                const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
                TRY(launch_stacked<T>(m, n_cols, x16 + v * n_cols, group, stream));
            }
            return PEBBLE_OK;
        }));
        p = end;
    }
    return PEBBLE_OK;
#endif
}

#ifndef PEBBLE_HOST_BUILD
pebble_status check_device_pointer(const void * ptr, const char * what, const char * fn) {
    cudaPointerAttributes attr = {};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        cudaGetLastError();
        attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type == cudaMemoryTypeUnregistered) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s (%p) is pageable host memory; kernels need device, "
                    "managed or pinned host memory", fn, what, ptr);
    }
    return PEBBLE_OK;
}
#endif

} // namespace pebble_internal

// ---------------------------------------------------------------------------------------------------
// quantized tensors

extern "C" pebble_status pebble_type_block(int32_t ggml_type, int64_t * block_elements, int64_t * block_bytes) {
    return with_type(ggml_type, __func__, [&](auto t) {
        using T = decltype(t);
        if (!block_elements || !block_bytes) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_type_block: %s: block_elements and block_bytes must "
                        "not be NULL", type_name(T::id));
        }
        *block_elements = T::block_elements;
        *block_bytes    = T::block_bytes;
        return PEBBLE_OK;
    });
}

extern "C" pebble_status pebble_dequantize(int32_t ggml_type, const void * src, uint64_t src_bytes,
                                           uint16_t * dst_f16, int64_t n_elements, void * stream) {
    return with_type(ggml_type, __func__, [&](auto t) {
        using T = decltype(t);
        const char * name = type_name(T::id);
        // The count first: with no elements, a caller's empty buffer may well be NULL.
        if (n_elements < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize: %s: n_elements must be at least 1, got %"
                        PRId64, name, n_elements);
        }
        if (!src || !dst_f16) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize: %s: src and dst_f16 must not be NULL "
                        "(src %p, dst_f16 %p)", name, src, static_cast<void *>(dst_f16));
        }
        if (n_elements % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize: %s: n_elements %" PRId64 " is not a multiple "
                        "of the %d-element block", name, n_elements, T::block_elements);
        }
        const int64_t n_blocks = n_elements / T::block_elements;
        if (n_blocks > INT64_MAX / T::block_bytes) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize: %s: %" PRId64 " elements take more than "
                        "2^63 bytes", name, n_elements);
        }
        const uint64_t want = static_cast<uint64_t>(n_blocks) * T::block_bytes;
        if (src_bytes != want) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize: %s: %" PRId64 " elements are %" PRId64
                        " blocks of %d bytes = %" PRIu64 " bytes, but src_bytes is %" PRIu64, name, n_elements,
                        n_blocks, T::block_bytes, want, src_bytes);
        }
#ifndef PEBBLE_HOST_BUILD
        TRY(check_reachable(src, "src", "pebble_dequantize", T::id));
        TRY(check_reachable(dst_f16, "dst_f16", "pebble_dequantize", T::id));
#endif
        return launch_dequantize<T>(static_cast<const uint8_t *>(src), dst_f16, n_blocks,
                                    static_cast<cudaStream_t>(stream));
    });
}

namespace {
// decode's emit for pebble_dequantize_rows (a lambda here would be host code called from host-device code)
struct float_store {
    float * out;
    __host__ __device__ void operator()(int i, float value) const { out[i] = value; }
};
} // namespace

extern "C" pebble_status pebble_dequantize_rows(int32_t ggml_type, const void * table, uint64_t table_bytes,
                                                int64_t n_cols, const int64_t * rows, int64_t n_rows, float * out) {
    return with_type(ggml_type, __func__, [&](auto t) -> pebble_status {
        using T = decltype(t);
        const char * name = type_name(T::id);
        if (n_rows < 0 || n_cols < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: n_cols must be at least 1 and "
                        "n_rows at least 0, got %" PRId64 " and %" PRId64, name, n_cols, n_rows);
        }
        if (n_rows == 0) return PEBBLE_OK;
        if (!table || !rows || !out) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: table, rows and out must not be "
                        "NULL (table %p, rows %p, out %p)", name, table, static_cast<const void *>(rows),
                        static_cast<void *>(out));
        }
        if (n_cols % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize_rows: %s: n_cols %" PRId64 " is not a multiple "
                        "of the %d-element block", name, n_cols, T::block_elements);
        }
        const int64_t blocks = n_cols / T::block_elements;
        if (blocks > INT64_MAX / T::block_bytes || n_rows > INT64_MAX / n_cols) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize_rows: %s: %" PRId64 " rows of %" PRId64
                        " elements overflow 64-bit sizes", name, n_rows, n_cols);
        }
        const uint64_t row_bytes = static_cast<uint64_t>(blocks) * T::block_bytes;
        if (table_bytes % row_bytes != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize_rows: %s: table_bytes %" PRIu64 " is not a "
                        "whole number of %" PRIu64 "-byte rows of %" PRId64 " elements", name, table_bytes, row_bytes,
                        n_cols);
        }
        const int64_t table_rows = static_cast<int64_t>(table_bytes / row_bytes);
        for (int64_t r = 0; r < n_rows; r++) { // all checked before any is written
            if (rows[r] < 0 || rows[r] >= table_rows) {
                if (table_rows == 0) {
                    return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: rows[%" PRId64 "] is %"
                                PRId64 "; the table is empty (table_bytes 0): it has no rows to take", name, r, rows[r]);
                }
                return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: rows[%" PRId64 "] is %" PRId64
                            "; the table has rows 0..%" PRId64, name, r, rows[r], table_rows - 1);
            }
        }
        for (int64_t r = 0; r < n_rows; r++) {
            const uint8_t * src = static_cast<const uint8_t *>(table) + static_cast<uint64_t>(rows[r]) * row_bytes;
            float * dst = out + r * n_cols;
            for (int64_t b = 0; b < blocks; b++) {
                float_store emit{dst + b * T::block_elements};
                for (int part = 0; part < T::parts; part++) T::decode(src + b * T::block_bytes, part, emit);
            }
        }
        return PEBBLE_OK;
    });
}

namespace {

#ifndef PEBBLE_HOST_BUILD
// fp16 bits of float32 x, rounded to nearest even (pebble_matmul_f32 on the GPU)
__global__ void to_half_kernel(const float * __restrict__ x, uint16_t * __restrict__ out, int64_t n) {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        out[i] = half_from_float(x[i]);
    }
}
#endif

// pebble_matvec's, pebble_matmul's and pebble_matmul_f32's checks and work: n_vec up to max_vec; x fp16,
// or float32 (x_f32) rounded to fp16 before it is multiplied.
pebble_status matvec_call(const char * fn, int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                          int64_t n_cols, const void * x, bool x_f32, int64_t n_vec, int64_t max_vec, float * y,
                          void * stream) {
    const char * x_name = x_f32 ? "x" : "x_f16";
    return with_type(ggml_type, fn, [&](auto t) {
        using T = decltype(t);
        const char * name = type_name(T::id);
        // The counts first: with nothing to compute, a caller's empty buffers may well be NULL.
        if (n_vec < 1 || n_vec > max_vec) {
            if (max_vec == INT64_MAX) {
                return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: n_vec must be at least 1, got %" PRId64, fn, name,
                            n_vec);
            }
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: n_vec %" PRId64 " is outside 1..%" PRId64, fn, name,
                        n_vec, max_vec);
        }
        if (n_rows < 1 || n_cols < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: n_rows and n_cols must be at least 1, "
                        "got %" PRId64 " x %" PRId64, fn, name, n_rows, n_cols);
        }
        if (!w || !x || !y) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: w, %s and y must not be NULL (w %p, "
                        "%s %p, y %p)", fn, name, x_name, w, x_name, x, static_cast<void *>(y));
        }
        if (n_cols % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: n_cols %" PRId64 " is not a multiple of the "
                        "%d-element block", fn, name, n_cols, T::block_elements);
        }
        // Every index the kernel forms (row bytes, x and y offsets) must fit in int64.
        const int64_t blocks_per_row = n_cols / T::block_elements;
        if (blocks_per_row > INT64_MAX / T::block_bytes || n_rows > INT64_MAX / (blocks_per_row * T::block_bytes) ||
            n_cols > INT64_MAX / n_vec || n_rows > INT64_MAX / n_vec) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %" PRId64 " x %" PRId64 " weights (or %" PRId64
                        " vectors of them) take more than 2^63 bytes", fn, name, n_rows, n_cols, n_vec);
        }
        const int64_t row_bytes = blocks_per_row * T::block_bytes;
        const uint64_t want = static_cast<uint64_t>(n_rows) * static_cast<uint64_t>(row_bytes);
        if (w_bytes != want) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %" PRId64 " rows of %" PRId64 " elements are %"
                        PRId64 " x %" PRId64 " = %" PRIu64 " bytes, but w_bytes is %" PRIu64, fn, name, n_rows,
                        n_cols, n_rows, row_bytes, want, w_bytes);
        }
#ifdef PEBBLE_HOST_BUILD
        (void)stream;
        (void)x_name;
        if (pebble_cpu::gpu_arithmetic() && (T::block_elements > 1 || n_cols % dense_part == 0)) {
            return host_gpu_matvec<T>(static_cast<const uint8_t *>(w), n_rows, n_cols, x, x_f32, n_vec, y, fn);
        }
        return pebble_cpu::matmul(T::id, static_cast<const uint8_t *>(w), n_rows, n_cols, x, x_f32, n_vec, y, fn);
#else
        TRY(check_reachable(w, "w", fn, T::id));
        TRY(check_reachable(x, x_name, fn, T::id));
        TRY(check_reachable(y, "y", fn, T::id));
        const cudaStream_t s = static_cast<cudaStream_t>(stream);
        const uint16_t * x_f16 = static_cast<const uint16_t *>(x);
        void * half = nullptr;
        if (x_f32) { // rounded to fp16 on the stream, into memory that lives as long as the call's kernels
            const int64_t n = n_vec * n_cols;
            if (cudaMallocAsync(&half, static_cast<size_t>(n) * 2, s) != cudaSuccess) {
                cudaGetLastError();
                return fail(PEBBLE_ERR_DEVICE_OOM, "%s: %s: no device memory for %" PRId64 " fp16 elements of x", fn,
                            name, n);
            }
            to_half_kernel<<<static_cast<unsigned>(std::min<int64_t>(max_grid, (n + 255) / 256)), 256, 0, s>>>(
                static_cast<const float *>(x), static_cast<uint16_t *>(half), n);
            x_f16 = static_cast<const uint16_t *>(half);
        }
        pebble_status status = PEBBLE_OK;
        for (int64_t v = 0; v < n_vec && status == PEBBLE_OK; v += PEBBLE_MATVEC_MAX_VEC) {
            const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
            status = launch_matvec<T>(static_cast<const uint8_t *>(w), n_rows, n_cols, x_f16 + v * n_cols, group,
                                      y + v * n_rows, s);
        }
        if (half) cudaFreeAsync(half, s);
        return status;
#endif
    });
}

} // namespace

extern "C" pebble_status pebble_matvec(int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                                       int64_t n_cols, const uint16_t * x_f16, int32_t n_vec, float * y,
                                       void * stream) {
    return matvec_call("pebble_matvec", ggml_type, w, w_bytes, n_rows, n_cols, x_f16, false, n_vec,
                       PEBBLE_MATVEC_MAX_VEC, y, stream);
}

extern "C" pebble_status pebble_matmul(int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                                       int64_t n_cols, const uint16_t * x_f16, int64_t n_vec, float * y,
                                       void * stream) {
    return matvec_call("pebble_matmul", ggml_type, w, w_bytes, n_rows, n_cols, x_f16, false, n_vec, INT64_MAX, y,
                       stream);
}

extern "C" pebble_status pebble_matmul_f32(int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                                           int64_t n_cols, const float * x, int64_t n_vec, float * y, void * stream) {
    return matvec_call("pebble_matmul_f32", ggml_type, w, w_bytes, n_rows, n_cols, x, true, n_vec, INT64_MAX, y,
                       stream);
}

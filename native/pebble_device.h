// pebble_device.h: what the library's kernel sources share: CUDA's qualifiers (empty in the host build),
// float32 and fp16 from their bits, and where a thread is (in the GPU's grid, or the one thread of the
// host build, in which a warp has one lane). Not part of the ABI.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef PEBBLE_HOST_BUILD
#    define __host__
#    define __device__
#    define __global__
#    define PEBBLE_UNROLL
#    define PEBBLE_UNROLL_BY_8
#else
#    include <cuda_fp16.h>
#    define PEBBLE_UNROLL _Pragma("unroll")
#    define PEBBLE_UNROLL_BY_8 _Pragma("unroll 8")
#endif

namespace pebble_internal {
// ---------------------------------------------------------------------------------------------------
// scalars: float32, fp16 and bf16 from their bits

__host__ __device__ inline float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

__host__ __device__ inline float half_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half(h));
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) return float_from_bits(sign | 0x7f800000 | (mant << 13)); // inf, NaN
    if (exp == 0) {                                                           // zero, subnormal
        const float v = static_cast<float>(mant) * 0x1p-24f;                  // exact in float32
        return sign ? -v : v;
    }
    return float_from_bits(sign | ((exp + 112) << 23) | (mant << 13));        // rebias 15 -> 127
#endif
}

// MXFP4's scale: half the 2^(e - 127) of an E8M0 byte e, as ggml's (and gguf-py's) e8m0_to_fp32_half reads
// it, e 0 and 1 the subnormals 2^-128 and 2^-127, e 255 (E8M0's NaN) 2^127.
__host__ __device__ inline float e8m0_half(uint32_t e) {
    return float_from_bits(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// The tables of 16 int8 that IQ4_NL's, IQ4_XS's and MXFP4's nibbles index, as two 64-bit constants each,
// entries 0..7 the bytes of lo and 8..15 those of hi: device code may use a constexpr scalar where it could
// not index a constexpr array at run time; the CPU's kernels lay them out as arrays (cpu/quants.h).
// -127, -104, -83, -65, -49, -35, -22, -10 | 1, 13, 25, 38, 53, 69, 89, 113 (gguf-py's IQ4_NL.kvalues)
constexpr uint64_t iq4_values_lo = 0xf6eaddcfbfad9881ull, iq4_values_hi = 0x7159453526190d01ull;
// 0, 1, 2, 3, 4, 6, 8, 12 | 0, -1, -2, -3, -4, -6, -8, -12: e2m1 doubled (gguf-py's MXFP4.kvalues)
constexpr uint64_t mxfp4_values_lo = 0x0c08060403020100ull, mxfp4_values_hi = 0xf4f8fafcfdfeff00ull;

// float32 -> fp16 bits, rounding to nearest even as __float2half_rn and numpy's astype(float16) do, in
// integer arithmetic alone (the reference the tests hold the host build to, bit for bit). The GPU uses it
// where the bits are stored byte by byte: an fp16 register stored with st.u8 came out with its low byte 0
// on an H200 (nvcc 13.0, sm_90), where the same bits through integer registers store as they should.
__host__ __device__ inline uint16_t half_bits_from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
    if (a > 0x7f800000) return static_cast<uint16_t>(sign | 0x7e00); // NaN stays NaN
    if (a >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00); // >= 65520 rounds past 65504: inf
    uint32_t h, rest, halfway;
    if (a >= 0x38800000) { // a normal half: rebias the exponent, keep 10 of the 23 mantissa bits
        h = (a >> 13) - (112u << 10);
        rest = a & 0x1fff;
        halfway = 0x1000;
    } else {               // a subnormal half or zero: the value in units of 2^-24
        const uint32_t shift = 126 - (a >> 23); // at least 14 here
        if (shift > 24) return static_cast<uint16_t>(sign); // below 2^-25: rounds to zero
        const uint32_t m = (a & 0x7fffff) | 0x800000;
        h = m >> shift;
        rest = m & ((1u << shift) - 1);
        halfway = 1u << (shift - 1);
    }
    h += rest > halfway || (rest == halfway && (h & 1)); // a carry moves into the exponent, as it should
    return static_cast<uint16_t>(sign | h);
}

// The same bits, through the GPU's conversion instruction on the device.
__host__ __device__ inline uint16_t half_from_float(float f) {
#ifdef __CUDA_ARCH__
    return __half_as_ushort(__float2half_rn(f));
#else
    return half_bits_from_float(f);
#endif
}

// ---------------------------------------------------------------------------------------------------
// where a thread is: in the GPU's grid, or the one thread of the host build

#ifdef PEBBLE_HOST_BUILD
constexpr int warp_lanes = 1;
inline int64_t grid_thread()   { return 0; }
inline int64_t grid_threads()  { return 1; }
inline int64_t grid_warp()     { return 0; }
inline int64_t grid_warps()    { return 1; }
inline int     warp_lane()     { return 0; }
inline float   warp_sum(float v) { return v; }
inline float   warp_max(float v) { return v; }
inline void    warp_sync()       {}
#else
constexpr int warp_lanes = 32;
__device__ inline int64_t grid_thread()  { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
__device__ inline int64_t grid_warp()    { return static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; }
__device__ inline int64_t grid_warps()   { return static_cast<int64_t>(gridDim.x) * blockDim.y; }
__device__ inline int     warp_lane()    { return static_cast<int>(threadIdx.x); }
__device__ inline float warp_sum(float v) {
    PEBBLE_UNROLL
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}
__device__ inline float warp_max(float v) {
    PEBBLE_UNROLL
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}
// Orders the warp's memory accesses: what one lane wrote before it, every lane reads after it.
__device__ inline void warp_sync() { __syncwarp(); }
#endif

} // namespace pebble_internal

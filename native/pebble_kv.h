// pebble_kv.h: the KV cache types the decode step and pebble_attend read and write: F32, F16, and
// llama.cpp's Q8_0 and Q4_0 blocks (32 values after an fp16 scale), encoded as llama.cpp's reference
// quantizers encode them (pyplugin/kv_types.py is the same in numpy; a test holds them together). A cache
// row of a block type is its values' blocks in order, so a head's blocks are its own where head_dim is a
// multiple of 32 (checked by the callers). Not part of the ABI.
#pragma once

#include <cmath>
#include <cstdint>

#include "pebble_device.h"

namespace pebble_internal {

constexpr int32_t kv_f32 = 0, kv_f16 = 1, kv_q4_0 = 2, kv_q8_0 = 8;
constexpr int32_t kv_block = 32;

__host__ __device__ inline bool kv_known(int32_t t) { return t == kv_f32 || t == kv_f16 || t == kv_q4_0 || t == kv_q8_0; }
__host__ __device__ inline bool kv_blocked(int32_t t) { return t == kv_q4_0 || t == kv_q8_0; }
__host__ __device__ inline int64_t kv_block_bytes(int32_t t) { return t == kv_q8_0 ? 34 : 18; }

// Bytes of n values of type t (n a multiple of 32 for a block type).
__host__ __device__ inline int64_t kv_bytes(int32_t t, int64_t n) {
    return t == kv_f32 ? 4 * n : t == kv_f16 ? 2 * n : n / kv_block * kv_block_bytes(t);
}

// What one writer stores at a time: a value, or a block of 32.
__host__ __device__ inline int64_t kv_units(int32_t t, int64_t n) { return kv_blocked(t) ? n / kv_block : n; }

// a * b rounded, never fused with a following add (nvcc contracts by default; the reference does not).
__host__ __device__ inline float kv_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

// Value i of a row (or of a whole cache: its rows are contiguous).
__host__ __device__ inline float kv_load(const void * p, int32_t t, int64_t i) {
    if (t == kv_f32) return static_cast<const float *>(p)[i];
    if (t == kv_f16) return half_to_float(static_cast<const uint16_t *>(p)[i]);
    const uint8_t * b = static_cast<const uint8_t *>(p) + (i / kv_block) * kv_block_bytes(t);
    const float d = half_to_float(static_cast<uint16_t>(b[0] | (b[1] << 8)));
    const int64_t o = i % kv_block;
    if (t == kv_q8_0) return d * static_cast<float>(static_cast<int8_t>(b[2 + o]));
    const int q = o < 16 ? (b[2 + o] & 0x0F) : (b[2 + o - 16] >> 4);
    return d * static_cast<float>(q - 8);
}

// (integer conversion: pebble_device.h says why)
__host__ __device__ inline void kv_put_scale(uint8_t * b, float d) {
    const uint16_t h = half_bits_from_float(d);
    b[0] = static_cast<uint8_t>(h & 0xFF);
    b[1] = static_cast<uint8_t>(h >> 8);
}

// Unit u of src (n values of float32) into dst, a row of type t: value u, or block u of 32.
__host__ __device__ inline void kv_store_unit(const float * src, void * dst, int32_t t, int64_t u) {
    if (t == kv_f32) {
        static_cast<float *>(dst)[u] = src[u];
        return;
    }
    if (t == kv_f16) {
        static_cast<uint16_t *>(dst)[u] = half_from_float(src[u]);
        return;
    }
    const float * x = src + u * kv_block;
    uint8_t * b = static_cast<uint8_t *>(dst) + u * kv_block_bytes(t);
    if (t == kv_q8_0) { // d = max |x| / 127, values rounded half away from zero
        float amax = 0.0f;
        for (int j = 0; j < kv_block; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        kv_put_scale(b, d);
        for (int j = 0; j < kv_block; j++) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(roundf(x[j] * id)));
        return;
    }
    // q4_0: the value of largest magnitude (the first such) maps to -8
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kv_block; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    kv_put_scale(b, d);
    for (int j = 0; j < kv_block / 2; j++) {
        const int lo = static_cast<int8_t>(kv_mul_rn(x[j], id) + 8.5f);
        const int hi = static_cast<int8_t>(kv_mul_rn(x[j + 16], id) + 8.5f);
        b[2 + j] = static_cast<uint8_t>((lo < 15 ? lo : 15) | ((hi < 15 ? hi : 15) << 4));
    }
}

} // namespace pebble_internal

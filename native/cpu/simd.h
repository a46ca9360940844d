// cpu/simd.h: what the host library's CPU kernels (cpu/) share of the instruction sets: which one this
// CPU runs (simd_in_use, chosen once in cpu/pool.cc: AVX-512, AVX2 or portable C++), the target
// attributes that compile a function for AVX2 or AVX-512 whatever the build's -march, fp16 loads, the sum of
// a register's eight lanes, and exp(x) for x <= 0 in float32, scalar and eight at a time (AVX2), for the
// softmaxes and the activations.
// exp(n ln 2 + r) = 2^n exp(r) with |r| <= ln 2 / 2 and exp(r) by Cephes' degree-6 polynomial: a relative
// error about 1e-7, as std::exp's float. Below -87 (e^-87 < 2e-38) the result is exactly 0, as a
// softmax wants for masked (-inf) scores. Not part of the ABI.
#pragma once

#include "pebble_device.h"

#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#    define PEBBLE_X86 1
// GCC 12's AVX-512 headers start their undefined registers from themselves (GCC bug 105593), which
// -Wuninitialized reports wherever such an intrinsic is inlined; GCC 13's headers do not.
#    if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#        pragma GCC diagnostic ignored "-Wuninitialized"
#        pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#    endif
#    include <immintrin.h>
#endif

namespace pebble_cpu {

using pebble_internal::half_to_float;

enum class simd { portable, avx2, avx512 };

// The best instruction set this CPU has that PEBBLING_SIMD allows: 'portable' turns the SIMD kernels
// off and 'avx2' AVX-512's (to test each set on one machine); read_thread_setting refuses other values.
simd simd_in_use();

inline float exp_nonpositive(float x) {
    if (!(x >= -87.0f)) return 0.0f;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return std::ldexp(p, static_cast<int>(n));
}

#if defined(__x86_64__) || defined(__i386__)
// The sum of v's eight lanes: the halves added, then lanes 0 + 2 and 1 + 3, then those two (every kernel
// sums in this order, so a dot product is the same whichever kernel made it).
__attribute__((target("avx2,fma,f16c"), always_inline)) inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 exp8_nonpositive(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

#endif

inline uint16_t u16(const uint8_t * p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
inline float f16(const uint8_t * p) { return half_to_float(u16(p)); }

// ---------------------------------------------------------------------------------------------------
// AVX2 (+FMA, F16C): the row kernels, the attention and the activations

#ifdef PEBBLE_X86
#    define AVX2 __attribute__((target("avx2,fma,f16c")))
// Loops over a kernel's vectors, unrolled whole where they are written, so that each vector's accumulator is
// a register of its own (left to the optimizer, an array of them went to the stack, zeroed per row).
#    define UNROLL _Pragma("GCC unroll 16")

// fp16 bits to float with F16C's conversion (pebble_internal::half_to_float's values, in one instruction).
AVX2 inline float f16c(const uint8_t * p) { return _cvtsh_ss(u16(p)); }

AVX2 inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// ---------------------------------------------------------------------------------------------------
// AVX-512 (F, BW, DQ, VL, VNNI) row kernels: 64 quants a register and VNNI's fused integer dot products
// (vpdpbusd: bytes to int32 sums of 4; vpdpwssd: a sub-block's 16-bit sums times its scale, added).
// Their activations are laid out for them (quantize_pairs, quantize_k512): the same d and q as the
// other kernels', only arranged so that one load gives what a register of weights meets.

#    define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

} // namespace pebble_cpu

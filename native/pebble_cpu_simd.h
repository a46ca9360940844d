// pebble_cpu_simd.h: what the host library's kernels (native/pebble_cpu.cc, pebble_cpu_prompt.cc) share:
// the sum of a register's eight lanes, and exp(x) for x <= 0 in float32, scalar and eight at a time
// (AVX2), for the attention's softmaxes.
// exp(n ln 2 + r) = 2^n exp(r) with |r| <= ln 2 / 2 and exp(r) by Cephes' degree-6 polynomial: a relative
// error about 1e-7, as std::exp's float. Below -87 (e^-87 < 2e-38) the result is exactly 0, as a
// softmax wants for masked (-inf) scores. Not part of the ABI.
#pragma once

#include <cmath>

#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#endif

namespace pebble_cpu {

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

} // namespace pebble_cpu

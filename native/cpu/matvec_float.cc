// cpu/matvec_float.cc: the CPU's row kernels for F32, F16 and BF16 weights: one weight row times up to 4
// float32 activations (x rounded to fp16 first, or as it is for the decode step's dense weights), summed
// in float32; portable C++ and AVX2 (eight weights a register, F16C's conversion, fused multiply-adds, the
// row's last elements one by one). cpu/matmul.cc runs them over a matrix's rows.

#include "cpu/quants.h"

#include <cstdint>
#include <cstring>

namespace pebble_cpu {
namespace {

template <int K>
inline float float_weight(const uint8_t * w, int64_t c) {
    if constexpr (K == k_f32) {
        float f;
        std::memcpy(&f, w + 4 * c, 4);
        return f;
    } else if constexpr (K == k_f16) {
        return f16(w + 2 * c);
    } else {
        return pebble_internal::float_from_bits(static_cast<uint32_t>(u16(w + 2 * c)) << 16);
    }
}

// F32 / F16 / BF16: x is float32 (nb = the row's elements).
template <int K, int NV>
void dot_float_portable(const uint8_t * w, int64_t nb, const uint8_t * xq, int64_t xs, float * out) {
    float acc[NV] = {};
    for (int64_t c = 0; c < nb; c++) {
        const float wc = float_weight<K>(w, c);
        for (int v = 0; v < NV; v++) acc[v] += wc * reinterpret_cast<const float *>(xq + v * xs)[c];
    }
    for (int v = 0; v < NV; v++) out[v] = acc[v];
}

#ifdef PEBBLE_X86
template <int K>
AVX2 inline __m256 load8_weights(const uint8_t * w, int64_t c) {
    if constexpr (K == k_f32) {
        return _mm256_loadu_ps(reinterpret_cast<const float *>(w + 4 * c));
    } else if constexpr (K == k_f16) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w + 2 * c)));
    } else {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w + 2 * c)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
}

template <int K, int NV>
AVX2 void dot_float_avx2(const uint8_t * w, int64_t n, const uint8_t * xq, int64_t xs, float * out) {
    __m256 acc[NV];
    UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 wv = load8_weights<K>(w, c);
        UNROLL for (int v = 0; v < NV; v++) {
            acc[v] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(reinterpret_cast<const float *>(xq + v * xs) + c), acc[v]);
        }
    }
    UNROLL for (int v = 0; v < NV; v++) {
        float s = hsum_ps(acc[v]);
        for (int64_t t = c; t < n; t++) s += float_weight<K>(w, t) * reinterpret_cast<const float *>(xq + v * xs)[t];
        out[v] = s;
    }
}
#endif

// ---------------------------------------------------------------------------------------------------
// the family's kernel sets (cpu/quants.h)

PEBBLE_DOT(float_portable, dot_float_portable)
#ifdef PEBBLE_X86
PEBBLE_DOT(float_avx2, dot_float_avx2)
#endif

// The AVX2 and the portable kernels of a float type: one table, the family of row functions its argument.
template <template <int> class Float>
kernel_set four_at_a_time(int32_t type) {
    switch (type) {
        case 0:  return set_of<Float, k_f32>(act::f32, 1, 4, 4);
        case 1:  return set_of<Float, k_f16>(act::f32, 1, 2, 4);
        case 30: return set_of<Float, k_bf16>(act::f32, 1, 2, 4);
    }
    return {act::f32, 0, 0, 0, {}, {}};
}

} // namespace

// (AVX-512 CPUs run the AVX2 kernels.)
kernel_set float_kernels(int32_t type, simd level) {
#ifdef PEBBLE_X86
    if (level != simd::portable) return four_at_a_time<float_avx2>(type);
#endif
    (void)level;
    return four_at_a_time<float_portable>(type);
}

} // namespace pebble_cpu

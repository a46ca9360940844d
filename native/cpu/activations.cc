// cpu/activations.cc: the host library's gated activation of the feed-forward, out = silu(gate) * up
// (SwiGLU), gelu(gate) * up with GELU's tanh approximation, or gpt-oss's clamped SwiGLU, float32, among the
// pool's threads: eight at
// a time on AVX2 (exp by cpu/simd.h's polynomial, a short last group masked), else as the GPU's kernels
// compute it (cuda/activations.cu).

#include "cpu/cpu.h"
#include "cpu/simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pebble_cpu {

namespace {

// The portable gate, as the CUDA kernels compute it (swiglu_kernel, geglu_kernel, swiglu_oai_kernel in
// cuda/activations.cu).
float gated_one(int32_t activation, float g, float u) {
    if (activation == 1) return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    if (activation == 2) {
        g = std::min(g, 7.0f);
        return g / (1.0f + std::exp(1.702f * -g)) * (std::min(std::max(u, -7.0f), 7.0f) + 1.0f);
    }
    return g / (1.0f + std::exp(-g)) * u;
}

#ifdef PEBBLE_X86
// Eight elements: sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|); tanh(y) =
// sign(y) (1 - e) / (1 + e), e = exp(-2|y|). Every exp's argument is <= 0, as exp8_nonpositive wants.
// gpt-oss's (activation 2): x = min(g, 7), f = x sigmoid(1.702 x), times clamp(u, -7, 7) + 1.
AVX2 void gated_avx2(int32_t activation, const float * g, const float * u, int64_t begin, int64_t end, float * out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), limit = _mm256_set1_ps(7.0f);
    for (int64_t i = begin; i < end; i += 8) {
        const int left = static_cast<int>(std::min<int64_t>(8, end - i));
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 x = _mm256_maskload_ps(g + i, mask), up = _mm256_maskload_ps(u + i, mask);
        __m256 f;
        if (activation == 2) {
            x = _mm256_min_ps(x, limit);
            const __m256 a = _mm256_mul_ps(_mm256_set1_ps(1.702f), x);
            const __m256 e = exp8_nonpositive(_mm256_or_ps(a, sign));
            const __m256 s = _mm256_div_ps(_mm256_blendv_ps(e, one, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ)),
                                           _mm256_add_ps(one, e));
            f = _mm256_mul_ps(x, s);
            up = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(up, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit), one);
        } else if (activation == 1) {
            const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                           _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(x, x)), x, x));
            const __m256 e = exp8_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, y)));
            const __m256 t = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), _mm256_and_ps(y, sign));
            f = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
        } else {
            const __m256 e = exp8_nonpositive(_mm256_or_ps(x, sign));
            const __m256 s = _mm256_div_ps(_mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ)),
                                           _mm256_add_ps(one, e));
            f = _mm256_mul_ps(x, s);
        }
        _mm256_maskstore_ps(out + i, mask, _mm256_mul_ps(f, up));
    }
}
#endif

} // namespace

void gated(int32_t activation, const float * gate, const float * up, int64_t n, float * out) {
    // ranges of whole groups of eight, so that no thread's range ends inside one
    const int64_t groups = (n + 7) / 8;
    parallel_for(groups, n * 16, [=](int64_t begin, int64_t end) {
        const int64_t b = begin * 8, e = std::min(n, end * 8);
#ifdef PEBBLE_X86
        if (simd_in_use() != simd::portable) {
            gated_avx2(activation, gate, up, b, e, out);
            return;
        }
#endif
        for (int64_t i = b; i < e; i++) out[i] = gated_one(activation, gate[i], up[i]);
    });
}

} // namespace pebble_cpu

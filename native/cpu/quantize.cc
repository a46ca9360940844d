// cpu/quantize.cc: x as the CPU's matrix kernels read it, made once per call: fp16 (or float32 rounded to
// fp16) vectors quantized to 8-bit blocks as llama.cpp's CPU backend quantizes them (d = max|x| / 127,
// q = round-half-even(x / d); per 256 elements with each 16's sum of q for the K-quants, per 32 with their
// sum for the 32-element types, and laid out for the AVX-512 kernels where they run), or float32 for the
// F32, F16 and BF16 weights; and pebble_cpu::quantize, the same blocks for the GPU arithmetic the host
// library runs with PEBBLING_SIMD=gpu.

#include "cpu/cpu.h"
#include "cpu/quants.h"
#include "pebble_internal.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

using pebble_internal::fail;
using pebble_internal::half_from_float;
using pebble_internal::half_to_float;

namespace pebble_cpu {
namespace {

#ifdef PEBBLE_X86
// quantize_block for N a multiple of 32, or false (nothing written) when the block holds an infinity or
// a NaN, which the scalar loop then takes. The products v * id round to nearest even in
// _mm256_cvtps_epi32, as std::nearbyint does.
template <int N>
__attribute__((target("avx2,fma,f16c"))) bool quantize_block_avx2(const uint16_t * x, float & d, int8_t * q) {
    static_assert(N % 32 == 0, "whole groups of 32");
    __m256 v[N / 8];
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    for (int i = 0; i < N / 8; i++) {
        v[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(x + 8 * i)));
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_mul_ps(v[i], zero), zero, _CMP_EQ_OQ)); // inf*0, NaN*0: NaN
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    if (_mm256_movemask_ps(finite) != 0xff) return false;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < N / 8; i += 4) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], id));
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 2], id)), e = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 3], id));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(q + 8 * i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    return true;
}
#endif

// n elements of fp16 x into d and q (the rounding is nearest-even, as numpy's rint: the stub's
// reference computes the very same q). A block with an infinity or NaN gets d = NaN and q = 0, so its
// products are NaN, as float products with it would be.
template <int N>
void quantize_block(const uint16_t * x, float & d, int8_t * q) {
#ifdef PEBBLE_X86
    if (simd_in_use() != simd::portable && quantize_block_avx2<N>(x, d, q)) return;
#endif
    float v[N], amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < N; i++) {
        v[i] = half_to_float(x[i]);
        finite = finite && std::isfinite(v[i]);
        amax = std::max(amax, std::fabs(v[i]));
    }
    if (!finite) {
        d = NAN;
        std::memset(q, 0, N);
        return;
    }
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < N; i++) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
}

void quantize_256(const uint16_t * x, int64_t n, q8_256 * out) {
    for (int64_t b = 0; b < n / 256; b++) {
        q8_256 & o = out[b];
        quantize_block<256>(x + 256 * b, o.d, o.qs);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += o.qs[16 * g + i];
            o.sums[g] = static_cast<int16_t>(s);
        }
    }
}

void quantize_32(const uint16_t * x, int64_t n, q8_32 * out) {
    for (int64_t b = 0; b < n / 32; b++) {
        q8_32 & o = out[b];
        quantize_block<32>(x + 32 * b, o.d, o.qs);
        int s = 0;
        for (int i = 0; i < 32; i++) s += o.qs[i];
        o.sum = s;
    }
}

// float32 to fp16 bits, rounded to nearest even as numpy's astype(float16) and F16C's conversion round
// (out of range: +-inf), with F16C where the CPU has it.
#ifdef PEBBLE_X86
__attribute__((target("avx2,f16c"))) void to_half_f16c(const float * x, int64_t n, uint16_t * out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i *>(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) out[i] = half_from_float(x[i]);
}
#endif

void to_half(const float * x, int64_t n, uint16_t * out) {
#ifdef PEBBLE_X86
    if (simd_in_use() != simd::portable) {
        to_half_f16c(x, n, out);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = half_from_float(x[i]);
}

void to_float(const uint16_t * x, int64_t n, float * out) {
    for (int64_t i = 0; i < n; i++) out[i] = half_to_float(x[i]);
}

#ifdef PEBBLE_X86
// Q4_K's and Q5_K's 64 bytes of quants hold sub-blocks (0, 2) in their low nibbles and (1, 3) in their
// high ones (then 4..7 likewise), so their x goes in as sub-blocks 0 2 1 3 4 6 5 7; Q6_K's in order.
void quantize_k512(const uint16_t * x, int64_t n, bool paired, q8_k512 * out) {
    static constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int64_t b = 0; b < n / 256; b++) {
        q8_k512 & o = out[b];
        int8_t q[256];
        quantize_block<256>(x + 256 * b, o.d, q);
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += q[16 * g + i];
            o.sums[g] = static_cast<int16_t>(sum);
        }
        for (int c = 0; c < 8; c++) std::memcpy(o.qs + 32 * c, q + 32 * (paired ? order[c] : c), 32);
    }
}
#endif

// Bytes of one activation of n_cols elements in layout a.
int64_t activation_bytes(act a, int64_t n_cols) {
    switch (a) {
        case act::q8_256:         return (n_cols / 256) * static_cast<int64_t>(sizeof(q8_256));
        case act::q8_32:          return (n_cols / 32) * static_cast<int64_t>(sizeof(q8_32));
        case act::f32:            return n_cols * static_cast<int64_t>(sizeof(float));
#ifdef PEBBLE_X86
        case act::q8_k512:
        case act::q8_k512_paired: return (n_cols / 256) * static_cast<int64_t>(sizeof(q8_k512));
#else
        default:                  break;
#endif
    }
    return 0;
}

void quantize_activation(act a, const uint16_t * x, int64_t n_cols, uint8_t * out) {
    switch (a) {
        case act::q8_256: quantize_256(x, n_cols, reinterpret_cast<q8_256 *>(out)); break;
        case act::q8_32:  quantize_32(x, n_cols, reinterpret_cast<q8_32 *>(out)); break;
        case act::f32:    to_float(x, n_cols, reinterpret_cast<float *>(out)); break;
#ifdef PEBBLE_X86
        case act::q8_k512:        quantize_k512(x, n_cols, false, reinterpret_cast<q8_k512 *>(out)); break;
        case act::q8_k512_paired: quantize_k512(x, n_cols, true, reinterpret_cast<q8_k512 *>(out)); break;
#else
        default: break;
#endif
    }
}

} // namespace

void quantize(const uint16_t * x, int n, float & d, int8_t * q) {
    if (n == 256) {
        quantize_block<256>(x, d, q);
    } else {
        quantize_block<32>(x, d, q);
    }
}

// x's n_tok vectors as kernel set k's activations, quantized once (one 64-byte aligned buffer of n_tok rows
// of *xs bytes, the caller's to std::free), or taken as they are where dense weights are given float32
// vectors and exact_f32 asks for it.
pebble_status quantize_x(const kernel_set & k, int32_t ggml_type, int64_t n_cols, const void * x, bool x_f32,
                         int64_t n_tok, bool exact_f32, const char * fn, uint8_t ** out, int64_t * xs_out) {
    const int64_t xs = activation_bytes(k.activation, n_cols); // a multiple of 64 where a kernel needs it
    if (n_tok > (INT64_MAX - 63) / xs) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %" PRId64 " activations of %" PRId64 " take more than "
                    "2^63 bytes", fn, pebble_internal::ggml_type_name(ggml_type), n_tok, n_cols);
    }
    uint8_t * xq = static_cast<uint8_t *>(std::aligned_alloc(64, static_cast<size_t>((n_tok * xs + 63) / 64 * 64)));
    if (!xq) {
        return fail(PEBBLE_ERR_HOST_OOM, "%s: %s: no memory for %" PRId64 " quantized activations of %" PRId64
                    " (%" PRId64 " bytes)", fn, pebble_internal::ggml_type_name(ggml_type), n_tok, n_cols, n_tok * xs);
    }
    const bool as_they_are = x_f32 && exact_f32 && k.activation == act::f32;
    if (as_they_are) std::memcpy(xq, x, static_cast<size_t>(n_tok * n_cols) * sizeof(float));
    struct quantize_ctx { act a; const void * x; bool f32; int64_t n_cols, xs; uint8_t * xq; } qc{k.activation, x, x_f32,
                                                                                                n_cols, xs, xq};
    std::atomic<bool> no_memory{false};
    parallel_for(as_they_are ? 0 : n_tok, n_tok * n_cols * 4, [&qc, &no_memory](int64_t begin, int64_t end) {
        // float32 vectors: each rounded to fp16 here, then quantized as an fp16 vector is
        std::unique_ptr<uint16_t[]> half(qc.f32 ? new (std::nothrow) uint16_t[qc.n_cols] : nullptr);
        if (qc.f32 && !half) {
            no_memory = true;
            return;
        }
        for (int64_t t = begin; t < end; t++) {
            const uint16_t * xt = static_cast<const uint16_t *>(qc.x) + t * qc.n_cols;
            if (qc.f32) {
                to_half(static_cast<const float *>(qc.x) + t * qc.n_cols, qc.n_cols, half.get());
                xt = half.get();
            }
            quantize_activation(qc.a, xt, qc.n_cols, qc.xq + t * qc.xs);
        }
    });
    if (no_memory) {
        std::free(xq);
        return fail(PEBBLE_ERR_HOST_OOM, "%s: %s: no memory for a vector of %" PRId64 " fp16 elements", fn,
                    pebble_internal::ggml_type_name(ggml_type), n_cols);
    }
    *out = xq;
    *xs_out = xs;
    return PEBBLE_OK;
}

} // namespace pebble_cpu

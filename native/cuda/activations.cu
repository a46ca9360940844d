// cuda/activations.cu: element-wise operations of the decode step: the gated feed-forward's activation,
// out = silu(gate) * up (SwiGLU), out = gelu(gate) * up with GELU's tanh approximation (GeGLU) or gpt-oss's
// clamped SwiGLU, from
// float32 into the step's activations; and the logits' scale and soft-cap (c * tanh(l / c)); a row copied into the
// activations as it is, and a layer's slice of the per-layer inputs gathered (Gemma 4). The host
// library's gate is its CPU's SIMD loop among its threads (cpu/activations.cc).

#include "cuda/common.cuh"
#include "cuda/ops.cuh"

#include <cmath>
#include <cstdint>

using namespace pebble_internal;

namespace {

#ifndef PEBBLE_HOST_BUILD // (the host library's: pebble_cpu::gated, through gate_times_up below)
// out = silu(gate) * up, silu(g) = g / (1 + exp(-g))
__global__ void swiglu_kernel(const float * __restrict__ gate, const float * __restrict__ up, int64_t n,
                              act_t * __restrict__ out) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        const float g = gate[i];
        put(out, i, g / (1.0f + expf(-g)) * up[i]);
    }
}

// gpt-oss's: g = min(gate, 7), u = clamp(up, -7, 7), out = g * sigmoid(1.702 g) * (u + 1), as GGML's swiglu_oai
__global__ void swiglu_oai_kernel(const float * __restrict__ gate, const float * __restrict__ up, int64_t n,
                                  act_t * __restrict__ out) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        const float g = fminf(gate[i], 7.0f), u = fminf(fmaxf(up[i], -7.0f), 7.0f);
        put(out, i, g / (1.0f + expf(1.702f * -g)) * (u + 1.0f));
    }
}

// out = gelu(gate) * up, GELU's tanh approximation as pyplugin.model computes it
__global__ void geglu_kernel(const float * __restrict__ gate, const float * __restrict__ up, int64_t n,
                             act_t * __restrict__ out) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        const float g = gate[i];
        const float t = tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g));
        put(out, i, 0.5f * g * (1.0f + t) * up[i]);
    }
}
#endif

// logits *= scale, then c * tanh(l / c) where cap > 0
__global__ void logits_kernel(float * __restrict__ y, int64_t n, float scale, float cap) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        float l = scale == 1.0f ? y[i] : y[i] * scale;
        if (cap > 0.0f) l = tanhf(l / cap) * cap;
        y[i] = l;
    }
}

// out[i] = x[i] into the step's activations (rounded to fp16 on the GPU)
__global__ void to_act_kernel(const float * __restrict__ x, int64_t n, act_t * __restrict__ out) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) put(out, i, x[i]);
}

// dst[r][j] = src[r * stride + j] for n_rows rows of width
__global__ void gather_rows_kernel(const float * __restrict__ src, int64_t stride, int64_t n_rows, int64_t width,
                                   float * __restrict__ dst) {
    for (int64_t i = grid_thread(); i < n_rows * width; i += grid_threads()) dst[i] = src[i / width * stride + i % width];
}

} // namespace

// ---------------------------------------------------------------------------------------------------
// launchers (cuda/ops.cuh)

namespace pebble_internal {

// out = act(gate) * up for n elements (SiLU, or GELU's tanh approximation): the host library's SIMD loop
// split among its threads, the kernels above on the GPU.
pebble_status gate_times_up(int32_t activation, const float * gate, const float * up, int64_t n, act_t * out,
                            cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream;
    pebble_cpu::gated(activation, gate, up, n, out);
    return PEBBLE_OK;
#else
    if (activation == 2) {
        LAUNCH(swiglu_oai_kernel, grid_for(n, threads), threads, stream, gate, up, n, out);
    } else if (activation == 1) {
        LAUNCH(geglu_kernel, grid_for(n, threads), threads, stream, gate, up, n, out);
    } else {
        LAUNCH(swiglu_kernel, grid_for(n, threads), threads, stream, gate, up, n, out);
    }
    return launched();
#endif
}

pebble_status to_act(const float * x, int64_t n, act_t * out, [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(to_act_kernel, grid_for(n, threads), threads, stream, x, n, out);
    return launched();
}

pebble_status gather_rows(const float * src, int64_t stride, int64_t n_rows, int64_t width, float * dst,
                          [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(gather_rows_kernel, grid_for(n_rows * width, threads), threads, stream, src, stride, n_rows, width, dst);
    return launched();
}

pebble_status scale_logits(float * logits, int64_t n, float scale, float cap, [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(logits_kernel, grid_for(n, threads), threads, stream, logits, n, scale, cap);
    return launched();
}

} // namespace pebble_internal

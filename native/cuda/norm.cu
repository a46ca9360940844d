// cuda/norm.cu: RMS norms of float32 rows, weights F32 or F16: of the hidden state into the decode step's activations
// (out = x / rms(x) * w, a thread block a row on the GPU), of each head of q and k in place (Q/K norms, a warp a head)
// and of V without a weight (Gemma 4), Gemma 4's router input and the sum of its two FFN halves each normed, a scale
// read from a weight (Gemma 4's layer output scale), and the residual adds they meet: x += o * scale, o normed first
// where the layer has a post-norm (the Gemmas'), and the add fused with the norm that follows it. The kernels are
// written once (pebble_device.h): in the host build a kernel is a plain function run as one thread, which walks each
// row in order.

#include "cuda/common.cuh"
#include "cuda/ops.cuh"

#include <cmath>
#include <cstdint>

using namespace pebble_internal;

namespace {

// One warp per head of src [n_heads][head_dim]: dst = src / sqrt(mean(src^2) + eps) * w (float32), w NULL: no
// weight (Gemma 4's V). src may be dst (the Q/K norms in place; V normed where it is, or from K's projection).
__global__ void head_norm_kernel(const float * src, float * dst, int32_t n_heads, int32_t head_dim, const void * w,
                                 int32_t w_type, float eps) {
    for (int64_t h = grid_warp(); h < n_heads; h += grid_warps()) {
        const float * sh = src + h * head_dim;
        float * dh = dst + h * head_dim;
        float sum = 0.0f;
        for (int64_t i = warp_lane(); i < head_dim; i += warp_lanes) sum += sh[i] * sh[i];
        sum = warp_sum(sum);
        const float scale = 1.0f / sqrtf(sum / static_cast<float>(head_dim) + eps);
        warp_sync();
        for (int64_t i = warp_lane(); i < head_dim; i += warp_lanes) {
            dh[i] = w ? sh[i] * scale * load_value(w, w_type, i) : sh[i] * scale;
        }
    }
}

// x[i] *= w[0] for n elements (Gemma 4's layer output scale, read where the kernel runs so a graph replays).
__global__ void scale_by_kernel(float * __restrict__ x, int64_t n, const void * w, int32_t w_type) {
    const float c = load_value(w, w_type, 0);
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) x[i] = x[i] * c;
}

// The norms over a row of the hidden state run a thread block a row on the GPU (a decode step has one to
// eight rows: one warp a row, reading 4096 floats 32 at a time, took 15.7 us on the H200, most of a layer's
// small kernels); the host build's one thread walks each row in order.
constexpr int norm_threads = 256;

#ifndef PEBBLE_HOST_BUILD
// The sum of the squares of row xr's n values over the thread block: each thread its own elements (i = its
// index, then every norm_threads), the warps' sums met in shared memory and added by every thread in one
// order, so that each has the same total.
__device__ inline float block_sum_squares(const float * xr, int64_t n, float (&partial)[norm_threads / 32]) {
    const int t = static_cast<int>(threadIdx.x);
    float sum = 0.0f;
    PEBBLE_UNROLL_BY_8 // loads ahead of the sums, which stay in order
    for (int64_t i = t; i < n; i += norm_threads) sum += xr[i] * xr[i];
    sum = warp_sum(sum);
    __syncthreads(); // every thread has read the last row's partials
    if (t % 32 == 0) partial[t / 32] = sum;
    __syncthreads();
    float total = 0.0f;
    PEBBLE_UNROLL
    for (int k = 0; k < norm_threads / 32; k++) total += partial[k];
    return total;
}
#endif

// x[r] += rms_norm(o[r]) * w * scale for each of n_rows rows of n (the Gemmas' norm on a block's output
// before its residual), every row in one launch.
__global__ void norm_add_rows_kernel(float * __restrict__ x, const float * __restrict__ o, int64_t n_rows, int64_t n,
                                     const void * w, int32_t w_type, float eps, float scale) {
#ifdef PEBBLE_HOST_BUILD
    for (int64_t r = 0; r < n_rows; r++) {
        const float * orow = o + r * n;
        float * xr = x + r * n;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += orow[i] * orow[i];
        const float norm = 1.0f / sqrtf(sum / static_cast<float>(n) + eps);
        for (int64_t i = 0; i < n; i++) xr[i] = xr[i] + orow[i] * norm * load_value(w, w_type, i) * scale;
    }
#else
    __shared__ float partial[norm_threads / 32];
    const int t = static_cast<int>(threadIdx.x);
    for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const float * orow = o + r * n;
        float * xr = x + r * n;
        const float norm = 1.0f / sqrtf(block_sum_squares(orow, n, partial) / static_cast<float>(n) + eps);
        for (int64_t i = t; i < n; i += norm_threads) {
            xr[i] = xr[i] + orow[i] * norm * load_value(w, w_type, i) * scale;
        }
    }
#endif
}

// x + y * scale, y as it is where scale is 1 (the residual add, wherever it is made)
__host__ __device__ inline float added(float x, float y, float scale) { return scale == 1.0f ? x + y : x + y * scale; }

// x += y * scale
__global__ void add_kernel(float * __restrict__ x, const float * __restrict__ y, int64_t n, float scale) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) x[i] = added(x[i], y[i], scale);
}

// y[r][i] += b[offset + i] for n_rows rows of width: on the host row by row (no division an element: a
// gpt-oss step adds some 37,000 bias values a layer), on the GPU a thread an element.
__global__ void bias_rows_kernel(float * __restrict__ y, int64_t n_rows, int64_t width, const void * b, int32_t b_type,
                                 int64_t offset) {
#ifdef PEBBLE_HOST_BUILD
    for (int64_t r = 0; r < n_rows; r++) {
        float * yr = y + r * width;
        if (b_type == f32_type) {
            const float * br = static_cast<const float *>(b) + offset;
            for (int64_t i = 0; i < width; i++) yr[i] += br[i];
        } else {
            for (int64_t i = 0; i < width; i++) yr[i] += load_value(b, b_type, offset + i);
        }
    }
#else
    for (int64_t i = grid_thread(); i < n_rows * width; i += grid_threads()) y[i] += load_value(b, b_type, offset + i % width);
#endif
}

// out[r] = x[r] / rms(x[r]) * w for each of n_rows rows of n.
__global__ void rms_rows_kernel(const float * __restrict__ x, int64_t n_rows, int64_t n, const void * w, int32_t w_type,
                                float eps, act_t * __restrict__ out) {
#ifdef PEBBLE_HOST_BUILD
    for (int64_t r = 0; r < n_rows; r++) {
        const float * xr = x + r * n;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(sum / static_cast<float>(n) + eps);
        for (int64_t i = 0; i < n; i++) put(out, r * n + i, xr[i] * scale * load_value(w, w_type, i));
    }
#else
    __shared__ float partial[norm_threads / 32];
    const int t = static_cast<int>(threadIdx.x);
    for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const float * xr = x + r * n;
        const float scale = 1.0f / sqrtf(block_sum_squares(xr, n, partial) / static_cast<float>(n) + eps);
        PEBBLE_UNROLL_BY_8
        for (int64_t i = t; i < n; i += norm_threads) put(out, r * n + i, xr[i] * scale * load_value(w, w_type, i));
    }
#endif
}

// x[r] += o[r] * add_scale (a residual), then out[r] = x[r] / rms(x[r]) * w: add_kernel and rms_rows_kernel
// in one launch, the same values (each thread adds the elements it then sums and normalizes).
__global__ void add_rms_rows_kernel(float * __restrict__ x, const float * __restrict__ o, int64_t n_rows, int64_t n,
                                    float add_scale, const void * w, int32_t w_type, float eps,
                                    act_t * __restrict__ out) {
#ifdef PEBBLE_HOST_BUILD
    for (int64_t i = 0; i < n_rows * n; i++) x[i] = added(x[i], o[i], add_scale);
    rms_rows_kernel(x, n_rows, n, w, w_type, eps, out);
#else
    __shared__ float partial[norm_threads / 32];
    const int t = static_cast<int>(threadIdx.x);
    for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
        float * xr = x + r * n;
        const float * orow = o + r * n;
        PEBBLE_UNROLL_BY_8
        for (int64_t i = t; i < n; i += norm_threads) xr[i] = added(xr[i], orow[i], add_scale);
        const float scale = 1.0f / sqrtf(block_sum_squares(xr, n, partial) / static_cast<float>(n) + eps);
        PEBBLE_UNROLL_BY_8
        for (int64_t i = t; i < n; i += norm_threads) put(out, r * n + i, xr[i] * scale * load_value(w, w_type, i));
    }
#endif
}

// out[r] = x[r] / rms(x[r]) * (w / divisor) for each of n_rows rows of n: Gemma 4's router input (x normed
// without a weight, times ffn_gate_inp_s over sqrt(n_embd)), each factor rounded as the forward pass rounds it.
__global__ void scaled_rms_rows_kernel(const float * __restrict__ x, int64_t n_rows, int64_t n, const void * w,
                                       int32_t w_type, float divisor, float eps, act_t * __restrict__ out) {
#ifdef PEBBLE_HOST_BUILD
    for (int64_t r = 0; r < n_rows; r++) {
        const float * xr = x + r * n;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(sum / static_cast<float>(n) + eps);
        for (int64_t i = 0; i < n; i++) put(out, r * n + i, (xr[i] * scale) * (load_value(w, w_type, i) / divisor));
    }
#else
    __shared__ float partial[norm_threads / 32];
    const int t = static_cast<int>(threadIdx.x);
    for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const float * xr = x + r * n;
        const float scale = 1.0f / sqrtf(block_sum_squares(xr, n, partial) / static_cast<float>(n) + eps);
        for (int64_t i = t; i < n; i += norm_threads) {
            put(out, r * n + i, (xr[i] * scale) * (load_value(w, w_type, i) / divisor));
        }
    }
#endif
}

// a[r] = rms_norm(b[r]) * wb + rms_norm(a[r]) * wa for each of n_rows rows of n (Gemma 4: the dense FFN's
// output b and the experts' a, each normed after, then added).
__global__ void two_norms_add_kernel(float * __restrict__ a, const float * __restrict__ b, int64_t n_rows, int64_t n,
                                     const void * wa, int32_t wa_type, const void * wb, int32_t wb_type, float eps) {
#ifdef PEBBLE_HOST_BUILD
    for (int64_t r = 0; r < n_rows; r++) {
        float * ar = a + r * n;
        const float * br = b + r * n;
        float sa = 0.0f, sb = 0.0f;
        for (int64_t i = 0; i < n; i++) sa += ar[i] * ar[i];
        for (int64_t i = 0; i < n; i++) sb += br[i] * br[i];
        const float na = 1.0f / sqrtf(sa / static_cast<float>(n) + eps), nb = 1.0f / sqrtf(sb / static_cast<float>(n) + eps);
        for (int64_t i = 0; i < n; i++) {
            ar[i] = br[i] * nb * load_value(wb, wb_type, i) + ar[i] * na * load_value(wa, wa_type, i);
        }
    }
#else
    __shared__ float partial[norm_threads / 32];
    const int t = static_cast<int>(threadIdx.x);
    for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
        float * ar = a + r * n;
        const float * br = b + r * n;
        const float na = 1.0f / sqrtf(block_sum_squares(ar, n, partial) / static_cast<float>(n) + eps);
        const float nb = 1.0f / sqrtf(block_sum_squares(br, n, partial) / static_cast<float>(n) + eps);
        for (int64_t i = t; i < n; i += norm_threads) {
            ar[i] = br[i] * nb * load_value(wb, wb_type, i) + ar[i] * na * load_value(wa, wa_type, i);
        }
    }
#endif
}

} // namespace

// ---------------------------------------------------------------------------------------------------
// launchers (cuda/ops.cuh)

namespace pebble_internal {

// rms_rows_kernel over n rows of e values, normed by w: one launch.
pebble_status norm_rows(const float * x, int64_t n, int64_t e, const pebble_tensor_ref & w, float eps, act_t * out,
                        [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(rms_rows_kernel, grid_for(n, 1), norm_threads, stream, x, n, e, w.data, w.ggml_type, eps, out);
    return launched();
}

pebble_status scaled_norm_rows(const float * x, int64_t n, int64_t e, const pebble_tensor_ref & w, float divisor,
                               float eps, act_t * out, [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(scaled_rms_rows_kernel, grid_for(n, 1), norm_threads, stream, x, n, e, w.data, w.ggml_type, divisor, eps,
           out);
    return launched();
}

pebble_status two_norms_add(float * a, const float * b, int64_t n, int64_t e, const pebble_tensor_ref & wa,
                            const pebble_tensor_ref & wb, float eps, [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(two_norms_add_kernel, grid_for(n, 1), norm_threads, stream, a, b, n, e, wa.data, wa.ggml_type, wb.data,
           wb.ggml_type, eps);
    return launched();
}

pebble_status add_norm_rows(float * x, const float * o, int64_t n, int64_t e, float add_scale,
                            const pebble_tensor_ref & w, float eps, act_t * out, [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(add_rms_rows_kernel, grid_for(n, 1), norm_threads, stream, x, o, n, e, add_scale, w.data, w.ggml_type, eps,
           out);
    return launched();
}

// x += o (normed by `norm` where given) * residual_scale
pebble_status residual(float * x, const float * o, int64_t n_rows, int64_t e, const pebble_tensor_ref & norm,
                       const pebble_layer_shape & s, [[maybe_unused]] cudaStream_t stream) {
    if (norm.data) {
        LAUNCH(norm_add_rows_kernel, grid_for(n_rows, 1), norm_threads, stream, x, o, n_rows, e, norm.data,
               norm.ggml_type, s.rms_eps, s.residual_scale);
    } else {
        LAUNCH(add_kernel, grid_for(n_rows * e, threads), threads, stream, x, o, n_rows * e, s.residual_scale);
    }
    return launched();
}

pebble_status head_norm(float * y, int32_t n_heads, int32_t head_dim, const pebble_tensor_ref & w, float eps,
                        [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(head_norm_kernel, grid_for(n_heads, heads_per_block), dim3(warp_lanes, heads_per_block), stream, y, y, n_heads,
           head_dim, w.data, w.ggml_type, eps);
    return launched();
}

pebble_status v_norm(const float * src, float * dst, int32_t n_heads, int32_t head_dim, float eps,
                     [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(head_norm_kernel, grid_for(n_heads, heads_per_block), dim3(warp_lanes, heads_per_block), stream, src, dst,
           n_heads, head_dim, nullptr, 0, eps);
    return launched();
}

pebble_status scale_by(float * x, int64_t n, const pebble_tensor_ref & w, [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(scale_by_kernel, grid_for(n, threads), threads, stream, x, n, w.data, w.ggml_type);
    return launched();
}

pebble_status add_scaled(float * x, const float * y, int64_t n, float scale, [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(add_kernel, grid_for(n, threads), threads, stream, x, y, n, scale);
    return launched();
}

pebble_status add_bias(float * y, int64_t n_rows, int64_t width, const pebble_tensor_ref & b, int64_t offset,
                       [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(bias_rows_kernel, grid_for(n_rows * width, threads), threads, stream, y, n_rows, width, b.data, b.ggml_type,
           offset);
    return launched();
}

} // namespace pebble_internal

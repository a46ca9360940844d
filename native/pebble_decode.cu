// pebble_decode.cu: the decode step of pebble.h, one transformer layer for one token in one call.
//
// At batch 1 every operation of a layer is small, and what costs is launching it; here the whole layer
// is enqueued from C: RMS norm, Q/K/V projections (pebble_quant.cu's matrix-vector kernel, one vector),
// biases, per-head Q/K norms where given, RoPE with the new K/V row written into the caches (a ring's row
// pos % n_ctx), attention (soft-capped where asked), the output projection, its norm where given and the
// residual, RMS norm, the SwiGLU or GELU-tanh gated feed-forward, its norm where given and its residual.
// The arithmetic, and its order, is pyplugin.model's forward pass on the CPU path with quantized weights:
// float32 throughout, the vectors that enter a matrix kernel rounded to fp16, probabilities normalised
// before they weight V.
//
// Kernels are written once (pebble_device.h): in the host build a kernel is a plain function run as one
// thread and a warp has one lane, so CI runs this file's arithmetic and indexing; the launcher follows.

#include "pebble_device.h"
#include "pebble_internal.h"
#ifdef PEBBLE_HOST_BUILD
#    include "pebble_cpu.h"
#endif

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <initializer_list>

using namespace pebble_internal;

namespace {

constexpr int32_t f32_type = 0, f16_type = 1;

__host__ __device__ inline float load_value(const void * p, int32_t type, int64_t i) {
    return type == f32_type ? static_cast<const float *>(p)[i] : half_to_float(static_cast<const uint16_t *>(p)[i]);
}

__host__ __device__ inline void store_value(void * p, int32_t type, int64_t i, float v) {
    if (type == f32_type) {
        static_cast<float *>(p)[i] = v;
    } else {
        static_cast<uint16_t *>(p)[i] = half_from_float(v);
    }
}

// ---------------------------------------------------------------------------------------------------
// kernels

// One warp: out = fp16(x * (1 / sqrt(mean(x^2) + eps)) * w).
__global__ void rms_norm_kernel(const float * __restrict__ x, int64_t n, const void * w, int32_t w_type, float eps,
                                uint16_t * __restrict__ out) {
    if (grid_warp() != 0) return;
    float sum = 0.0f;
    for (int64_t i = warp_lane(); i < n; i += warp_lanes) sum += x[i] * x[i];
    sum = warp_sum(sum);
    const float scale = 1.0f / sqrtf(sum / static_cast<float>(n) + eps);
    for (int64_t i = warp_lane(); i < n; i += warp_lanes) out[i] = half_from_float(x[i] * scale * load_value(w, w_type, i));
}

// One warp per head of y [n_heads][head_dim], in place: y = y / sqrt(mean(y^2) + eps) * w (float32).
__global__ void head_norm_kernel(float * __restrict__ y, int32_t n_heads, int32_t head_dim, const void * w,
                                 int32_t w_type, float eps) {
    for (int64_t h = grid_warp(); h < n_heads; h += grid_warps()) {
        float * yh = y + h * head_dim;
        float sum = 0.0f;
        for (int64_t i = warp_lane(); i < head_dim; i += warp_lanes) sum += yh[i] * yh[i];
        sum = warp_sum(sum);
        const float scale = 1.0f / sqrtf(sum / static_cast<float>(head_dim) + eps);
        warp_sync();
        for (int64_t i = warp_lane(); i < head_dim; i += warp_lanes) yh[i] = yh[i] * scale * load_value(w, w_type, i);
    }
}

// One warp: x += rms_norm(o) * w * scale (the Gemmas' norm on a block's output before its residual).
__global__ void norm_add_kernel(float * __restrict__ x, const float * __restrict__ o, int64_t n, const void * w,
                                int32_t w_type, float eps, float scale) {
    if (grid_warp() != 0) return;
    float sum = 0.0f;
    for (int64_t i = warp_lane(); i < n; i += warp_lanes) sum += o[i] * o[i];
    sum = warp_sum(sum);
    const float norm = 1.0f / sqrtf(sum / static_cast<float>(n) + eps);
    for (int64_t i = warp_lane(); i < n; i += warp_lanes) x[i] = x[i] + o[i] * norm * load_value(w, w_type, i) * scale;
}

// The dim that dim d of a head is rotated with (itself past rope_dims, where sin is 0).
__host__ __device__ inline int64_t rope_partner(int64_t d, int32_t rope_dims, int32_t neox) {
    if (d >= rope_dims) return d;
    if (!neox) return d ^ 1;
    const int32_t half = rope_dims / 2;
    return d < half ? d + half : d - half;
}

struct qkv_args {
    const float * q, * k, * v;            // the projections
    pebble_tensor_ref bq, bk, bv;         // biases, data NULL when absent
    int32_t n_q, n_kv, head_dim, rope_dims, rope_neox, kv_type;
    const float * cos, * sin;
    float * q_out;                        // q with biases, rotated
    void * k_row, * v_row;                // row pos of the caches
};

__host__ __device__ inline float with_bias(const float * y, const pebble_tensor_ref & b, int64_t i) {
    return b.data ? y[i] + load_value(b.data, b.ggml_type, i) : y[i];
}

// One thread per element of q, k and v: biases, RoPE on q and k, k and v into the caches.
__global__ void qkv_kernel(qkv_args a) {
    const int64_t total = static_cast<int64_t>(a.n_q) + 2 * static_cast<int64_t>(a.n_kv);
    for (int64_t i = grid_thread(); i < total; i += grid_threads()) {
        if (i < a.n_q + a.n_kv) {
            const bool is_q = i < a.n_q;
            const int64_t j = is_q ? i : i - a.n_q;
            const float * y = is_q ? a.q : a.k;
            const pebble_tensor_ref & b = is_q ? a.bq : a.bk;
            const int64_t d = j % a.head_dim, partner = j - d + rope_partner(d, a.rope_dims, a.rope_neox);
            const float rotated = with_bias(y, b, j) * a.cos[d] + with_bias(y, b, partner) * a.sin[d];
            if (is_q) {
                a.q_out[j] = rotated;
            } else {
                store_value(a.k_row, a.kv_type, j, rotated);
            }
        } else {
            const int64_t j = i - a.n_q - a.n_kv;
            store_value(a.v_row, a.kv_type, j, with_bias(a.v, a.bv, j));
        }
    }
}

struct attention_args {
    const float * q;                      // rotated, unscaled
    const void * k_cache, * v_cache;
    int32_t kv_type, n_head, n_head_kv, head_dim;
    int64_t n_pos, n_ctx;                 // rows attended; rows of the scores buffer
    float scale, softcap;                 // softcap above 0: s -> c * tanh(s / c)
    float * scores;                       // n_head x n_ctx
    uint16_t * out;                       // n_head x head_dim, fp16
    float * out_f32;                      // ... or float32 where this is not NULL (pebble_attend)
};

// One warp per query head, over the rows of its KV head: scores, softmax (probabilities normalised
// first), then each lane takes dims of the weighted sum of V.
__global__ void attention_kernel(attention_args a) {
    const int32_t group = a.n_head / a.n_head_kv;
    const int64_t row = static_cast<int64_t>(a.n_head_kv) * a.head_dim;
    for (int64_t h = grid_warp(); h < a.n_head; h += grid_warps()) {
        const float * qh = a.q + h * a.head_dim;
        const int64_t kv = (h / group) * a.head_dim;
        float * sc = a.scores + h * a.n_ctx;
        float top = -INFINITY;
        for (int64_t s = warp_lane(); s < a.n_pos; s += warp_lanes) {
            float dot = 0.0f;
            for (int32_t d = 0; d < a.head_dim; d++) dot += (qh[d] * a.scale) * load_value(a.k_cache, a.kv_type, s * row + kv + d);
            if (a.softcap > 0.0f) dot = tanhf(dot / a.softcap) * a.softcap;
            sc[s] = dot;
            top = fmaxf(top, dot);
        }
        top = warp_max(top);
        float total = 0.0f;
        for (int64_t s = warp_lane(); s < a.n_pos; s += warp_lanes) {
            sc[s] = expf(sc[s] - top);
            total += sc[s];
        }
        total = warp_sum(total);
        for (int64_t s = warp_lane(); s < a.n_pos; s += warp_lanes) sc[s] = sc[s] / total;
        warp_sync(); // every lane reads every probability below
        for (int64_t d = warp_lane(); d < a.head_dim; d += warp_lanes) {
            float acc = 0.0f;
            for (int64_t s = 0; s < a.n_pos; s++) acc += sc[s] * load_value(a.v_cache, a.kv_type, s * row + kv + d);
            if (a.out_f32) {
                a.out_f32[h * a.head_dim + d] = acc;
            } else {
                a.out[h * a.head_dim + d] = half_from_float(acc);
            }
        }
    }
}

// A float32 row into a cache row of `type` (pebble_attend's new K and V rows).
__global__ void store_row_kernel(const float * __restrict__ src, void * dst, int32_t type, int64_t n) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) store_value(dst, type, i, src[i]);
}

// x += y * scale
__global__ void add_kernel(float * __restrict__ x, const float * __restrict__ y, int64_t n, float scale) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        x[i] = scale == 1.0f ? x[i] + y[i] : x[i] + y[i] * scale;
    }
}

// out = fp16(silu(gate) * up), silu(g) = g / (1 + exp(-g))
__global__ void swiglu_kernel(const float * __restrict__ gate, const float * __restrict__ up, int64_t n,
                              uint16_t * __restrict__ out) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        const float g = gate[i];
        out[i] = half_from_float(g / (1.0f + expf(-g)) * up[i]);
    }
}

// out = fp16(gelu(gate) * up), GELU's tanh approximation as pyplugin.model computes it
__global__ void geglu_kernel(const float * __restrict__ gate, const float * __restrict__ up, int64_t n,
                             uint16_t * __restrict__ out) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        const float g = gate[i];
        const float t = tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g));
        out[i] = half_from_float(0.5f * g * (1.0f + t) * up[i]);
    }
}

// ---------------------------------------------------------------------------------------------------
// launcher

#ifdef PEBBLE_HOST_BUILD
#    define LAUNCH(kernel, grid, block, stream, ...) kernel(__VA_ARGS__)
pebble_status launched() { return PEBBLE_OK; }
#else
#    define LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
pebble_status launched() {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        return fail(PEBBLE_ERR_CUDA, "pebble_decode_layer: a kernel could not be launched: %s", cudaGetErrorString(err));
    }
    return PEBBLE_OK;
}
#endif

constexpr int     threads = 256;
constexpr int     heads_per_block = 4;
constexpr int64_t max_grid = int64_t(1) << 20;

[[maybe_unused]] unsigned grid_for(int64_t n, int64_t per_block) {
    return static_cast<unsigned>(std::max<int64_t>(1, std::min(max_grid, (n + per_block - 1) / per_block)));
}

// Scratch: the fp16 vector a matrix kernel reads, and the float32 vectors between the steps.
struct scratch_layout {
    uint64_t h16, q, k, v, q_rot, scores, o, gate, up, bytes; // byte offsets, then the total
};

uint64_t aligned(uint64_t n) { return (n + 255) / 256 * 256; }

scratch_layout layout_of(const pebble_layer_shape & s, int64_t n_ctx) {
    const uint64_t q = uint64_t(s.n_head) * s.head_dim, kv = uint64_t(s.n_head_kv) * s.head_dim;
    const uint64_t widest = std::max<uint64_t>({uint64_t(s.n_embd), q, uint64_t(s.n_ff)});
    scratch_layout l{};
    uint64_t at = 0;
    auto take = [&at](uint64_t bytes) { const uint64_t here = at; at += aligned(bytes); return here; };
    l.h16 = take(2 * widest);
    l.q = take(4 * q);
    l.k = take(4 * kv);
    l.v = take(4 * kv);
    l.q_rot = take(4 * q);
    l.scores = take(4 * uint64_t(s.n_head) * uint64_t(n_ctx));
    l.o = take(4 * uint64_t(s.n_embd));
    l.gate = take(4 * uint64_t(s.n_ff));
    l.up = take(4 * uint64_t(s.n_ff));
    l.bytes = at;
    return l;
}

pebble_status check_shape(const pebble_layer_shape * s, int64_t n_ctx) {
    if (!s) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: shape must not be NULL");
    if (s->n_embd < 1 || s->n_head < 1 || s->n_head_kv < 1 || s->head_dim < 1 || s->n_ff < 1 || n_ctx < 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: n_embd %d, n_head %d, n_head_kv %d, head_dim %d, "
                    "n_ff %d and n_ctx %" PRId64 " must each be at least 1", s->n_embd, s->n_head, s->n_head_kv,
                    s->head_dim, s->n_ff, n_ctx);
    }
    if (s->n_head % s->n_head_kv != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: %d query heads cannot share %d KV heads evenly",
                    s->n_head, s->n_head_kv);
    }
    if (s->rope_dims < 0 || s->rope_dims > s->head_dim || s->rope_dims % 2 != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: rope_dims %d must be even and within 0..head_dim "
                    "(%d)", s->rope_dims, s->head_dim);
    }
    if (s->gelu != 0 && s->gelu != 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: gelu is %d; 0 (SwiGLU) or 1 (GELU) are accepted",
                    s->gelu);
    }
    if (s->ring != 0 && s->ring != 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: ring is %d; 0 or 1 are accepted", s->ring);
    }
    if (!(s->attn_softcap >= 0.0f) || !std::isfinite(s->attn_softcap) || !std::isfinite(s->residual_scale)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: attn_softcap %g must be finite and at least 0, "
                    "residual_scale %g finite", static_cast<double>(s->attn_softcap),
                    static_cast<double>(s->residual_scale));
    }
    if (n_ctx > INT64_MAX / 4 / s->n_head) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_decode_layer: n_ctx %" PRId64 " is too large", n_ctx);
    }
    return PEBBLE_OK;
}

// x += o (normed by `norm` where given) * residual_scale
pebble_status residual(float * x, const float * o, int64_t e, const pebble_tensor_ref & norm,
                       const pebble_layer_shape & s, [[maybe_unused]] cudaStream_t stream) {
    if (norm.data) {
        LAUNCH(norm_add_kernel, 1, dim3(warp_lanes, 1), stream, x, o, e, norm.data, norm.ggml_type, s.rms_eps,
               s.residual_scale);
    } else {
        LAUNCH(add_kernel, grid_for(e, threads), threads, stream, x, o, e, s.residual_scale);
    }
    return launched();
}

pebble_status check_vector(const char * what, const pebble_tensor_ref & t, bool optional) {
    if (!t.data) {
        return optional ? PEBBLE_OK
                        : fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: %s must not be NULL", what);
    }
    if (t.ggml_type != f32_type && t.ggml_type != f16_type) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: %s has GGUF type %d (%s); vectors must be "
                    "0 F32 or 1 F16", what, t.ggml_type, ggml_type_name(t.ggml_type));
    }
    return PEBBLE_OK;
}

pebble_status check_weight(const char * what, const pebble_tensor_ref & t, int64_t rows, int64_t cols) {
    if (!t.data) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: %s must not be NULL", what);
    return check_matrix("pebble_decode_layer", what, t.ggml_type, rows, cols);
}

} // namespace

extern "C" pebble_status pebble_decode_scratch_bytes(const pebble_layer_shape * shape, int64_t n_ctx, uint64_t * out) {
    TRY(check_shape(shape, n_ctx));
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_scratch_bytes: out must not be NULL");
    *out = layout_of(*shape, n_ctx).bytes;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_decode_layer(const pebble_layer_shape * shape, const pebble_layer_weights * weights,
                                             int32_t kv_type, void * k_cache, void * v_cache, int64_t n_ctx,
                                             int64_t pos, const float * rope_cos, const float * rope_sin,
                                             float attn_scale, float * x, void * scratch, uint64_t scratch_bytes,
                                             void * stream_ptr) {
    TRY(check_shape(shape, n_ctx));
    const pebble_layer_shape & s = *shape;
    if (!weights) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: weights must not be NULL");
    const pebble_layer_weights & w = *weights;
    const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
    TRY(check_vector("attn_norm", w.attn_norm, false));
    TRY(check_vector("ffn_norm", w.ffn_norm, false));
    TRY(check_vector("bq", w.bq, true));
    TRY(check_vector("bk", w.bk, true));
    TRY(check_vector("bv", w.bv, true));
    TRY(check_vector("q_norm", w.q_norm, true));
    TRY(check_vector("k_norm", w.k_norm, true));
    TRY(check_vector("post_attn_norm", w.post_attn_norm, true));
    TRY(check_vector("post_ffn_norm", w.post_ffn_norm, true));
    if ((w.q_norm.data || w.k_norm.data) && (w.bq.data || w.bk.data)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: Q/K norms together with Q/K biases are not "
                    "supported");
    }
    TRY(check_weight("wq", w.wq, q, e));
    TRY(check_weight("wk", w.wk, kv, e));
    TRY(check_weight("wv", w.wv, kv, e));
    TRY(check_weight("wo", w.wo, e, q));
    TRY(check_weight("w_gate", w.w_gate, s.n_ff, e));
    TRY(check_weight("w_up", w.w_up, s.n_ff, e));
    TRY(check_weight("w_down", w.w_down, e, s.n_ff));
    if (kv_type != f32_type && kv_type != f16_type) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: kv_type %d (%s); the caches must be 0 F32 or "
                    "1 F16", kv_type, ggml_type_name(kv_type));
    }
    if (!k_cache || !v_cache || !rope_cos || !rope_sin || !x || !scratch) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decode_layer: k_cache, v_cache, rope_cos, rope_sin, x and "
                    "scratch must not be NULL");
    }
    if (pos < 0 || (pos >= n_ctx && !s.ring)) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_decode_layer: position %" PRId64 " is outside the cache's "
                    "0..%" PRId64, pos, n_ctx - 1);
    }
    const scratch_layout l = layout_of(s, n_ctx);
    if (scratch_bytes < l.bytes) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_decode_layer: scratch holds %" PRIu64 " bytes; n_ctx %" PRId64
                    " needs %" PRIu64 " (pebble_decode_scratch_bytes)", scratch_bytes, n_ctx, l.bytes);
    }
#ifndef PEBBLE_HOST_BUILD
    const void * pointers[] = {x, scratch, k_cache, v_cache, rope_cos, rope_sin, w.attn_norm.data, w.ffn_norm.data,
                               w.wq.data, w.wk.data, w.wv.data, w.wo.data, w.w_gate.data, w.w_up.data, w.w_down.data};
    const char * names[] = {"x", "scratch", "k_cache", "v_cache", "rope_cos", "rope_sin", "attn_norm", "ffn_norm",
                            "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"};
    for (size_t i = 0; i < sizeof pointers / sizeof pointers[0]; i++) {
        TRY(check_device_pointer(pointers[i], names[i], "pebble_decode_layer"));
    }
    for (const pebble_tensor_ref * b : {&w.bq, &w.bk, &w.bv}) {
        if (b->data) TRY(check_device_pointer(b->data, "a bias", "pebble_decode_layer"));
    }
    for (const pebble_tensor_ref * b : {&w.q_norm, &w.k_norm, &w.post_attn_norm, &w.post_ffn_norm}) {
        if (b->data) TRY(check_device_pointer(b->data, "a norm", "pebble_decode_layer"));
    }
#endif
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    uint8_t * base = static_cast<uint8_t *>(scratch);
    uint16_t * h16 = reinterpret_cast<uint16_t *>(base + l.h16);
    float * fq = reinterpret_cast<float *>(base + l.q), * fk = reinterpret_cast<float *>(base + l.k);
    float * fv = reinterpret_cast<float *>(base + l.v), * q_rot = reinterpret_cast<float *>(base + l.q_rot);
    float * scores = reinterpret_cast<float *>(base + l.scores), * o = reinterpret_cast<float *>(base + l.o);
    float * gate = reinterpret_cast<float *>(base + l.gate), * up = reinterpret_cast<float *>(base + l.up);
    const size_t kv_item = kv_type == f32_type ? 4 : 2;
    const int64_t row = s.ring ? pos % n_ctx : pos;             // a ring keeps position p in row p % n_ctx
    const int64_t n_pos = std::min(pos + 1, n_ctx);            // its filled rows: the window
    void * k_row = static_cast<uint8_t *>(k_cache) + row * kv * kv_item;
    void * v_row = static_cast<uint8_t *>(v_cache) + row * kv * kv_item;

    // attention
    LAUNCH(rms_norm_kernel, 1, dim3(warp_lanes, 1), stream, x, e, w.attn_norm.data, w.attn_norm.ggml_type, s.rms_eps, h16);
    TRY(launched());
    TRY(matvec_one(w.wq.ggml_type, w.wq.data, q, e, h16, fq, stream));
    TRY(matvec_one(w.wk.ggml_type, w.wk.data, kv, e, h16, fk, stream));
    TRY(matvec_one(w.wv.ggml_type, w.wv.data, kv, e, h16, fv, stream));
    if (w.q_norm.data) {
        LAUNCH(head_norm_kernel, grid_for(s.n_head, heads_per_block), dim3(warp_lanes, heads_per_block), stream, fq,
               s.n_head, s.head_dim, w.q_norm.data, w.q_norm.ggml_type, s.rms_eps);
        TRY(launched());
    }
    if (w.k_norm.data) {
        LAUNCH(head_norm_kernel, grid_for(s.n_head_kv, heads_per_block), dim3(warp_lanes, heads_per_block), stream,
               fk, s.n_head_kv, s.head_dim, w.k_norm.data, w.k_norm.ggml_type, s.rms_eps);
        TRY(launched());
    }
    const qkv_args qa{fq, fk, fv, w.bq, w.bk, w.bv, static_cast<int32_t>(q), static_cast<int32_t>(kv), s.head_dim,
                      s.rope_dims, s.rope_neox, kv_type, rope_cos, rope_sin, q_rot, k_row, v_row};
    LAUNCH(qkv_kernel, grid_for(q + 2 * kv, threads), threads, stream, qa);
    TRY(launched());
    const attention_args aa{q_rot, k_cache, v_cache, kv_type, s.n_head, s.n_head_kv, s.head_dim, n_pos, n_ctx,
                            attn_scale, s.attn_softcap, scores, h16, nullptr};
    LAUNCH(attention_kernel, grid_for(s.n_head, heads_per_block), dim3(warp_lanes, heads_per_block), stream, aa);
    TRY(launched());
    TRY(matvec_one(w.wo.ggml_type, w.wo.data, e, q, h16, o, stream));
    TRY(residual(x, o, e, w.post_attn_norm, s, stream));

    // feed-forward
    LAUNCH(rms_norm_kernel, 1, dim3(warp_lanes, 1), stream, x, e, w.ffn_norm.data, w.ffn_norm.ggml_type, s.rms_eps, h16);
    TRY(launched());
    TRY(matvec_one(w.w_gate.ggml_type, w.w_gate.data, s.n_ff, e, h16, gate, stream));
    TRY(matvec_one(w.w_up.ggml_type, w.w_up.data, s.n_ff, e, h16, up, stream));
    if (s.gelu) {
        LAUNCH(geglu_kernel, grid_for(s.n_ff, threads), threads, stream, gate, up, s.n_ff, h16);
    } else {
        LAUNCH(swiglu_kernel, grid_for(s.n_ff, threads), threads, stream, gate, up, s.n_ff, h16);
    }
    TRY(launched());
    TRY(matvec_one(w.w_down.ggml_type, w.w_down.data, e, s.n_ff, h16, o, stream));
    return residual(x, o, e, w.post_ffn_norm, s, stream);
}

// ---------------------------------------------------------------------------------------------------
// attention of a batch of sequences, one query each

extern "C" pebble_status pebble_attend_scratch_bytes(int32_t n_seq, int32_t n_head, int64_t n_rows, uint64_t * out) {
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend_scratch_bytes: out must not be NULL");
    if (n_seq < 1 || n_head < 1 || n_rows < 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend_scratch_bytes: n_seq %d, n_head %d and n_rows %" PRId64
                    " must each be at least 1", n_seq, n_head, n_rows);
    }
    if (n_rows > INT64_MAX / 4 / n_head / n_seq) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_attend_scratch_bytes: n_rows %" PRId64 " is too large", n_rows);
    }
    *out = 4 * uint64_t(n_seq) * uint64_t(n_head) * uint64_t(n_rows);
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_attend(int32_t n_seq, const float * q, const float * k_new, const float * v_new,
                                       int32_t kv_type, void * const * k_caches,
                                       void * const * v_caches, const int64_t * n_pos, int64_t n_rows, int32_t n_head,
                                       int32_t n_head_kv, int32_t head_dim, float scale, float softcap, float * out,
                                       void * scratch, uint64_t scratch_bytes, void * stream_ptr) {
    if (!q || !k_caches || !v_caches || !n_pos || !out || !scratch) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend: q, k_caches, v_caches, n_pos, out and scratch must "
                    "not be NULL");
    }
    if (!k_new != !v_new) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend: k_new and v_new go together (both rows, or both NULL)");
    }
    if (n_seq < 1 || n_head < 1 || n_head_kv < 1 || head_dim < 1 || n_rows < 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend: n_seq %d, n_head %d, n_head_kv %d, head_dim %d and "
                    "n_rows %" PRId64 " must each be at least 1", n_seq, n_head, n_head_kv, head_dim, n_rows);
    }
    if (n_head % n_head_kv != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend: %d query heads cannot share %d KV heads evenly",
                    n_head, n_head_kv);
    }
    if (kv_type != f32_type && kv_type != f16_type) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend: kv_type %d (%s); the caches must be 0 F32 or 1 F16",
                    kv_type, ggml_type_name(kv_type));
    }
    if (!(softcap >= 0.0f) || !std::isfinite(softcap) || !std::isfinite(scale)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend: scale %g and softcap %g must be finite, softcap at "
                    "least 0", static_cast<double>(scale), static_cast<double>(softcap));
    }
    uint64_t need = 0;
    TRY(pebble_attend_scratch_bytes(n_seq, n_head, n_rows, &need));
    if (scratch_bytes < need) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_attend: scratch holds %" PRIu64 " bytes; %d sequences of %d heads "
                    "over %" PRId64 " rows need %" PRIu64 " (pebble_attend_scratch_bytes)", scratch_bytes, n_seq, n_head,
                    n_rows, need);
    }
    for (int32_t b = 0; b < n_seq; b++) {
        if (!k_caches[b] || !v_caches[b]) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend: sequence %d has a NULL cache", b);
        }
        if (n_pos[b] < 1 || n_pos[b] > n_rows) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_attend: sequence %d attends over %" PRId64 " rows; 1..%" PRId64
                        " are in its cache", b, n_pos[b], n_rows);
        }
    }
    const int64_t kv_width = int64_t(n_head_kv) * head_dim, kv_item = kv_type == f16_type ? 2 : 4;
#ifdef PEBBLE_HOST_BUILD
    (void)stream_ptr;
    for (int32_t b = 0; k_new && b < n_seq; b++) {
        const int64_t at = (n_pos[b] - 1) * kv_width * kv_item;
        store_row_kernel(k_new + b * kv_width, static_cast<uint8_t *>(k_caches[b]) + at, kv_type, kv_width);
        store_row_kernel(v_new + b * kv_width, static_cast<uint8_t *>(v_caches[b]) + at, kv_type, kv_width);
    }
    return pebble_cpu::attend(n_seq, q, kv_type == f16_type, k_caches, v_caches, n_pos, n_rows, n_head, n_head_kv,
                              head_dim, scale, softcap, out, static_cast<float *>(scratch));
#else
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    const int64_t width = int64_t(n_head) * head_dim;
    if (k_new) {
        TRY(check_device_pointer(k_new, "k_new", "pebble_attend"));
        TRY(check_device_pointer(v_new, "v_new", "pebble_attend"));
    }
    for (int32_t b = 0; b < n_seq; b++) {
        TRY(check_device_pointer(k_caches[b], "k_caches[b]", "pebble_attend"));
        TRY(check_device_pointer(v_caches[b], "v_caches[b]", "pebble_attend"));
        if (k_new) {
            const int64_t at = (n_pos[b] - 1) * kv_width * kv_item;
            LAUNCH(store_row_kernel, grid_for(kv_width, threads), threads, stream, k_new + b * kv_width,
                   static_cast<uint8_t *>(k_caches[b]) + at, kv_type, kv_width);
            LAUNCH(store_row_kernel, grid_for(kv_width, threads), threads, stream, v_new + b * kv_width,
                   static_cast<uint8_t *>(v_caches[b]) + at, kv_type, kv_width);
        }
        const attention_args aa{q + b * width, k_caches[b], v_caches[b], kv_type, n_head, n_head_kv, head_dim, n_pos[b],
                                n_rows, scale, softcap, static_cast<float *>(scratch) + int64_t(b) * n_head * n_rows,
                                nullptr, out + b * width};
        LAUNCH(attention_kernel, grid_for(n_head, heads_per_block), dim3(warp_lanes, heads_per_block), stream, aa);
        TRY(launched());
    }
    return PEBBLE_OK;
#endif
}

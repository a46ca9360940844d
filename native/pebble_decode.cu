// pebble_decode.cu: the decode step of pebble.h, one transformer layer for one token in one call.
//
// At batch 1 every operation of a layer is small, and what costs is launching it; here the whole layer
// is enqueued from C: RMS norm, Q/K/V projections (pebble_quant.cu's matrix-vector kernel, one vector),
// biases, per-head Q/K norms where given, RoPE with the new K/V row written into the caches (a ring's row
// pos % n_ctx), attention (soft-capped where asked), the output projection, its norm where given and the
// residual, RMS norm, the SwiGLU or GELU-tanh gated feed-forward, its norm where given and its residual.
// A layer of experts replaces that feed-forward: its router's scores are read back to the host, which
// chooses each token's experts, then expert by expert the tokens routed to it are gathered and run through
// it (its rows read once for them all), from its merged tensors or from a per-layer cache of experts
// restored from a store (experts_ffn, cached_expert), guessed and restored early where asked
// (prefetch_experts: those restores are on the step's stream, so on the GPU they do not yet overlap compute).
// The arithmetic, and its order, is pyplugin.model's forward pass on the CPU path with quantized weights:
// float32 throughout, the vectors that enter a matrix kernel rounded to fp16, probabilities normalised
// before they weight V.
//
// Kernels are written once (pebble_device.h): in the host build a kernel is a plain function run as one
// thread and a warp has one lane, so CI runs this file's arithmetic and indexing; the launcher follows.

#include "pebble_device.h"
#include "pebble_internal.h"
#include "pebble_kv.h"
#ifdef PEBBLE_HOST_BUILD
#    include "cpu/cpu.h"
#endif

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <array>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

using namespace pebble_internal;

namespace {

constexpr int32_t f32_type = 0, f16_type = 1;

__host__ __device__ inline float load_value(const void * p, int32_t type, int64_t i) {
    return type == f32_type ? static_cast<const float *>(p)[i] : half_to_float(static_cast<const uint16_t *>(p)[i]);
}

// ---------------------------------------------------------------------------------------------------
// kernels

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

// The dim that dim d of a head is rotated with (itself past rope_dims, where sin is 0).
__host__ __device__ inline int64_t rope_partner(int64_t d, int32_t rope_dims, int32_t neox) {
    if (d >= rope_dims) return d;
    if (!neox) return d ^ 1;
    const int32_t half = rope_dims / 2;
    return d < half ? d + half : d - half;
}

// A kernel's arguments for up to launch_group sequences of a step, launched once with the sequence in
// blockIdx.y (the host build runs them in turn): a step of 8 sequences made 8 launches of each per layer.
// PEBBLING_CUDA_GROUP sets fewer (switches().group).
constexpr int32_t launch_group = pebble_internal::max_launch_group;

template <typename A> struct arg_group {
    A       a[launch_group];
    int32_t n = 0;
};

// body(a) for the sequence of this thread block, or for each in turn on the host.
#ifdef PEBBLE_HOST_BUILD
template <typename A, typename F> inline void for_group(const arg_group<A> & g, F && body) {
    for (int32_t b = 0; b < g.n; b++) body(g.a[b]);
}
#else
template <typename A, typename F> __device__ inline void for_group(const arg_group<A> & g, F && body) {
    if (static_cast<int32_t>(blockIdx.y) < g.n) body(g.a[blockIdx.y]);
}
#endif

struct qkv_args {
    const float * q, * k, * v;            // the projections
    pebble_tensor_ref bq, bk, bv;         // biases, data NULL when absent
    int32_t n_q, n_kv, head_dim, rope_dims, rope_neox;
    const float * cos, * sin;             // the RoPE tables, a row of head_dim per position
    const int64_t * pos;                  // the token's position, read where the kernel runs (so a graph replays)
    float * q_out, * k_out, * v_out;      // q and k with biases, rotated; v with its bias (float32)
};

__host__ __device__ inline float with_bias(const float * y, const pebble_tensor_ref & b, int64_t i) {
    return b.data ? y[i] + load_value(b.data, b.ggml_type, i) : y[i];
}

// One thread per element of q, k and v: biases, RoPE on q and k (kv_row_kernel then stores k and v).
[[maybe_unused]] __global__ void qkv_kernel(arg_group<qkv_args> g) {
    for_group(g, [](const qkv_args & a) {
        const int64_t total = static_cast<int64_t>(a.n_q) + 2 * static_cast<int64_t>(a.n_kv);
        const int64_t p = *a.pos;
        const float * cos = a.cos + p * a.head_dim, * sin = a.sin + p * a.head_dim;
        for (int64_t i = grid_thread(); i < total; i += grid_threads()) {
            if (i < a.n_q + a.n_kv) {
                const bool is_q = i < a.n_q;
                const int64_t j = is_q ? i : i - a.n_q;
                const float * y = is_q ? a.q : a.k;
                const pebble_tensor_ref & b = is_q ? a.bq : a.bk;
                const int64_t d = j % a.head_dim, partner = j - d + rope_partner(d, a.rope_dims, a.rope_neox);
                const float rotated = with_bias(y, b, j) * cos[d] + with_bias(y, b, partner) * sin[d];
                (is_q ? a.q_out : a.k_out)[j] = rotated;
            } else {
                const int64_t j = i - a.n_q - a.n_kv;
                a.v_out[j] = with_bias(a.v, a.bv, j);
            }
        }
    });
}

#ifdef PEBBLE_HOST_BUILD
// qkv_kernel's arithmetic on the host, head by head (the kernel's per-element division by head_dim was
// most of its cost on a CPU): the same values, bit for bit.
void qkv_rows(const qkv_args & a) {
    const int64_t p = *a.pos;
    const float * cos = a.cos + p * a.head_dim, * sin = a.sin + p * a.head_dim;
    for (int pass = 0; pass < 2; pass++) {
        const float * y = pass ? a.k : a.q;
        const pebble_tensor_ref & bias = pass ? a.bk : a.bq;
        float * out = pass ? a.k_out : a.q_out;
        for (int64_t head = 0; head < (pass ? a.n_kv : a.n_q); head += a.head_dim) {
            for (int32_t d = 0; d < a.head_dim; d++) {
                const int64_t j = head + d, partner = head + rope_partner(d, a.rope_dims, a.rope_neox);
                out[j] = with_bias(y, bias, j) * cos[d] + with_bias(y, bias, partner) * sin[d];
            }
        }
    }
    for (int64_t j = 0; j < a.n_kv; j++) a.v_out[j] = with_bias(a.v, a.bv, j);
}

// What a value of qkv_rows and kv_row_kernel costs, in the pool's units (about a multiply-add): measured at
// 3-4 ns a value on one core, so a step of 8 sequences is split between threads.
constexpr int64_t qkv_work_per_value = 160;
#endif

// One thread per unit (a value, or a block of 32: pebble_kv.h) of the new K and V rows (float32, n_kv
// each) into the token's row of the caches: row pos, or pos % kv_rows in a ring.
struct kv_row_args {
    const float * k, * v;                 // the new rows, float32
    void *        k_cache, * v_cache;
    int32_t       type;
    int64_t       n_kv;
    const int64_t * pos;
    int64_t       kv_rows;
    int32_t       ring;
};

__device__ inline void kv_row(const kv_row_args & a) {
    const int64_t p = *a.pos, row = a.ring ? p % a.kv_rows : p, units = kv_units(a.type, a.n_kv);
    const int64_t at = row * kv_bytes(a.type, a.n_kv);
    for (int64_t u = grid_thread(); u < 2 * units; u += grid_threads()) {
        const bool is_k = u < units;
        kv_store_unit(is_k ? a.k : a.v, static_cast<uint8_t *>(is_k ? a.k_cache : a.v_cache) + at, a.type,
                      is_k ? u : u - units);
    }
}

[[maybe_unused]] __global__ void kv_row_kernel(arg_group<kv_row_args> g) {
    for_group(g, [](const kv_row_args & a) { kv_row(a); });
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
    const int64_t * pos;                  // where not NULL, n_pos is min(*pos + 1, n_ctx), read on the device
    float * parts;                        // where not NULL, V summed a part of split_rows rows at a time, each
                                          // part weighted by its own softmax, into n_head x split_parts(n_ctx)
                                          // x head_dim, then each part's 2 (part_stats), then put together
};

// A decode step's weighted sum of V in parts of split_rows rows, each part's warps apart, then the parts
// put together in order (attention_parts_kernel): one warp's loop over every row set the step's time at long
// contexts (9.2 us at 144 rows on an H200, growing with the rows; PEBBLING_CUDA_SPLIT=0 puts it back).
constexpr int64_t split_rows = PEBBLE_DECODER_SPLIT_ROWS;
__host__ __device__ inline int64_t split_parts(int64_t rows) { return (rows + split_rows - 1) / split_rows; }
// Part `part` of head h's (largest score, sum of exp(score - largest)), after every head's part sums in a.parts.
__host__ __device__ inline float * part_stats(const attention_args & a, int64_t h, int64_t part) {
    const int64_t parts = split_parts(a.n_ctx);
    return a.parts + a.n_head * parts * a.head_dim + 2 * (h * parts + part);
}

// Attention of one query per head over the rows of its KV head, in passes that each spread over the
// GPU: one warp per head did it all (32 warps for a step's 32 heads: 31 us at 16 positions on an
// H200, each lane's V loop the whole context long).
//   attention_scores_kernel   a warp per (KV head, row), its lanes over the head's dims (the row's K read
//                             in whole lines, from L1 after the first of the KV head's query heads): each
//                             query head's scaled, softcapped score of the row (a lane a row, each reading
//                             its own row's K a value at a time, touched 32 lines a load)
//   attention_values_kernel   a warp per (head, 32 dims, part of the rows): the part's own softmax (its
//                             largest score and sum of exps) and its exps' weighted sum of V (see split_rows),
//                             then attention_parts_kernel puts the parts together (flash-decoding). With
//                             PEBBLING_CUDA_SPLIT=0 (and in pebble_attend, which has no parts), a warp per head
//                             first normalises the probabilities (attention_softmax_kernel: 32 warps for 32
//                             heads, each over every row) and the values kernel sums each head in one part.
// The host runs them in turn for each sequence where it has no SIMD (PEBBLING_SIMD=portable), so that
// its tests hold them to the forward pass; with its one lane a warp, a score sums the dims in order, where
// the GPU's lanes each take every 32nd and then add theirs up (the V parts are summed alike on both).
__host__ __device__ inline int64_t attention_rows(const attention_args & a) {
    return a.pos ? (*a.pos + 1 < a.n_ctx ? *a.pos + 1 : a.n_ctx) : a.n_pos;
}

[[maybe_unused]] __global__ void attention_scores_kernel(arg_group<attention_args> g) {
    for_group(g, [](const attention_args & a) {
        const int64_t n_pos = attention_rows(a);
        const int32_t group = a.n_head / a.n_head_kv;
        const int64_t row = static_cast<int64_t>(a.n_head_kv) * a.head_dim;
        for (int64_t u = grid_warp(); u < a.n_head_kv * n_pos; u += grid_warps()) {
            const int64_t s = u % n_pos, at = s * row + (u / n_pos) * a.head_dim; // KV head u / n_pos, row s
            for (int64_t h = (u / n_pos) * group; h < (u / n_pos + 1) * group; h++) {
                const float * qh = a.q + h * a.head_dim;
                float dot = 0.0f;
                for (int32_t d = warp_lane(); d < a.head_dim; d += warp_lanes) {
                    dot += (qh[d] * a.scale) * kv_load(a.k_cache, a.kv_type, at + d);
                }
                dot = warp_sum(dot); // every lane of the warp is here
                if (a.softcap > 0.0f) dot = tanhf(dot / a.softcap) * a.softcap;
                if (warp_lane() == 0) a.scores[h * a.n_ctx + s] = dot;
            }
        }
    });
}

// The scores as a lane a row (what ran on the H200 on 11-27; PEBBLING_CUDA_SPLIT=0): a warp per (head, 32
// rows), each lane reading its own row's K a value at a time.
[[maybe_unused]] __global__ void attention_scores_by_lane_kernel(arg_group<attention_args> g) {
    for_group(g, [](const attention_args & a) {
        const int64_t n_pos = attention_rows(a), chunks = (n_pos + warp_lanes - 1) / warp_lanes;
        const int32_t group = a.n_head / a.n_head_kv;
        const int64_t row = static_cast<int64_t>(a.n_head_kv) * a.head_dim;
        for (int64_t u = grid_warp(); u < a.n_head * chunks; u += grid_warps()) {
            const int64_t h = u / chunks, s = (u % chunks) * warp_lanes + warp_lane();
            if (s >= n_pos) continue; // no lane of this kernel waits for another
            const float * qh = a.q + h * a.head_dim;
            const int64_t kv = (h / group) * a.head_dim;
            float dot = 0.0f;
            for (int32_t d = 0; d < a.head_dim; d++) {
                dot += (qh[d] * a.scale) * kv_load(a.k_cache, a.kv_type, s * row + kv + d);
            }
            if (a.softcap > 0.0f) dot = tanhf(dot / a.softcap) * a.softcap;
            a.scores[h * a.n_ctx + s] = dot;
        }
    });
}

[[maybe_unused]] __global__ void attention_softmax_kernel(arg_group<attention_args> g) {
    for_group(g, [](const attention_args & a) {
        const int64_t n_pos = attention_rows(a);
        for (int64_t h = grid_warp(); h < a.n_head; h += grid_warps()) {
            float * sc = a.scores + h * a.n_ctx;
            float top = -INFINITY;
            for (int64_t s = warp_lane(); s < n_pos; s += warp_lanes) top = fmaxf(top, sc[s]);
            top = warp_max(top);
            float total = 0.0f;
            for (int64_t s = warp_lane(); s < n_pos; s += warp_lanes) {
                sc[s] = expf(sc[s] - top);
                total += sc[s];
            }
            total = warp_sum(total);
            for (int64_t s = warp_lane(); s < n_pos; s += warp_lanes) sc[s] = sc[s] / total;
        }
    });
}

// The output of query head h, dim d: float32 where out_f32 is given (pebble_attend), else fp16.
__host__ __device__ inline void put_attention(const attention_args & a, int64_t h, int64_t d, float value) {
    if (a.out_f32) {
        a.out_f32[h * a.head_dim + d] = value;
    } else {
        a.out[h * a.head_dim + d] = half_from_float(value);
    }
}

[[maybe_unused]] __global__ void attention_values_kernel(arg_group<attention_args> g) {
    for_group(g, [](const attention_args & a) {
        const int64_t n_pos = attention_rows(a), groups = (a.head_dim + warp_lanes - 1) / warp_lanes;
        const int64_t parts = a.parts ? split_parts(n_pos) : 1, span = a.parts ? split_rows : n_pos;
        const int32_t group = a.n_head / a.n_head_kv;
        const int64_t row = static_cast<int64_t>(a.n_head_kv) * a.head_dim;
        for (int64_t u = grid_warp(); u < a.n_head * parts * groups; u += grid_warps()) {
            const int64_t h = u / (parts * groups), part = u / groups % parts;
            const int64_t d = (u % groups) * warp_lanes + warp_lane();
            const float * sc = a.scores + h * a.n_ctx;
            const int64_t kv = (h / group) * a.head_dim, first = part * span;
            const int64_t end = first + span < n_pos ? first + span : n_pos;
            if (!a.parts) { // the probabilities, normalised by attention_softmax_kernel
                if (d >= a.head_dim) continue;
                float acc = 0.0f;
                PEBBLE_UNROLL_BY_8 // the loads ahead of the sums, which stay in order
                for (int64_t s = first; s < end; s++) acc += sc[s] * kv_load(a.v_cache, a.kv_type, s * row + kv + d);
                put_attention(a, h, d, acc);
                continue;
            }
            // The part's own softmax (flash-decoding): its largest score (every warp of the part needs it) and,
            // by the part's first warp alone, its sum of exp(score - largest), every lane of the warp over the
            // part's rows; then V weighted by exp(score - largest). attention_parts_kernel puts the parts together.
            float top = -INFINITY;
            for (int64_t s = first + warp_lane(); s < end; s += warp_lanes) top = fmaxf(top, sc[s]);
            top = warp_max(top);
            const float shift = top == -INFINITY ? 0.0f : top; // a part of -inf scores weighs nothing
            if (u % groups == 0) { // the same for the warp's lanes, so every lane of it is in warp_sum
                float total = 0.0f;
                for (int64_t s = first + warp_lane(); s < end; s += warp_lanes) total += expf(sc[s] - shift);
                total = warp_sum(total);
                if (warp_lane() == 0) {
                    float * stats = part_stats(a, h, part);
                    stats[0] = top;
                    stats[1] = total;
                }
            }
            if (d >= a.head_dim) continue;
            float acc = 0.0f;
            PEBBLE_UNROLL_BY_8
            for (int64_t s = first; s < end; s++) acc += expf(sc[s] - shift) * kv_load(a.v_cache, a.kv_type, s * row + kv + d);
            a.parts[(h * split_parts(a.n_ctx) + part) * a.head_dim + d] = acc;
        }
    });
}

// The parts put together, a thread per (head, dim) (after attention_values_kernel, where a.parts is given):
// each part's sum weighted by exp(its largest score - the largest of all), over the parts' weighted totals,
// the parts in order.
[[maybe_unused]] __global__ void attention_parts_kernel(arg_group<attention_args> g) {
    for_group(g, [](const attention_args & a) {
        const int64_t parts = split_parts(attention_rows(a)), stride = split_parts(a.n_ctx) * a.head_dim;
        for (int64_t u = grid_thread(); u < a.n_head * a.head_dim; u += grid_threads()) {
            const int64_t h = u / a.head_dim, d = u % a.head_dim;
            const float * p = a.parts + h * stride + d;
            float top = -INFINITY;
            for (int64_t part = 0; part < parts; part++) top = fmaxf(top, part_stats(a, h, part)[0]);
            const float shift = top == -INFINITY ? 0.0f : top;
            float acc = 0.0f, total = 0.0f;
            for (int64_t part = 0; part < parts; part++) {
                const float * stats = part_stats(a, h, part);
                const float weight = expf(stats[0] - shift);
                acc += weight * p[part * a.head_dim];
                total += weight * stats[1];
            }
            put_attention(a, h, d, acc / total);
        }
    });
}

// A float32 row of n values into a cache row of `type` (pebble_attend's new K and V rows), a unit a thread.
__global__ void store_row_kernel(const float * __restrict__ src, void * dst, int32_t type, int64_t n) {
    for (int64_t u = grid_thread(); u < kv_units(type, n); u += grid_threads()) kv_store_unit(src, dst, type, u);
}

// x + y * scale, y as it is where scale is 1 (the residual add, wherever it is made)
__host__ __device__ inline float added(float x, float y, float scale) { return scale == 1.0f ? x + y : x + y * scale; }

// x += y * scale
__global__ void add_kernel(float * __restrict__ x, const float * __restrict__ y, int64_t n, float scale) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) x[i] = added(x[i], y[i], scale);
}

// The decode step's activations, what its matrix products read: float32 in the host build (whose kernels
// round them to fp16 for quantized weights and take them as they are for dense ones, as the forward pass
// does), fp16 on the GPU.
#ifdef PEBBLE_HOST_BUILD
// Whether the host runs the GPU's own kernels where it has SIMD code of its own (qkv_rows, cpu/attend.cc's
// attend): without SIMD (PEBBLING_SIMD=portable), so that the host's tests hold those kernels to the
// forward pass too.
bool host_runs_gpu_kernels() {
    static const bool portable = std::strcmp(pebble_cpu::simd_level(), "portable") == 0;
    return portable;
}

using act_t = float;
__host__ __device__ inline void put(float * p, int64_t i, float v) { p[i] = v; }
__host__ __device__ inline float act_value(const float * p, int64_t i) { return p[i]; }
#else
using act_t = uint16_t;
__host__ __device__ inline void put(uint16_t * p, int64_t i, float v) { p[i] = half_from_float(v); }
__host__ __device__ inline float act_value(const uint16_t * p, int64_t i) { return half_to_float(p[i]); }
#endif

#ifndef PEBBLE_HOST_BUILD // (the host library's: pebble_cpu::gated, through gate_times_up below)
// out = silu(gate) * up, silu(g) = g / (1 + exp(-g))
__global__ void swiglu_kernel(const float * __restrict__ gate, const float * __restrict__ up, int64_t n,
                              act_t * __restrict__ out) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        const float g = gate[i];
        put(out, i, g / (1.0f + expf(-g)) * up[i]);
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
        return fail(PEBBLE_ERR_CUDA, "a kernel could not be launched: %s", cudaGetErrorString(err));
    }
    return PEBBLE_OK;
}
#endif

constexpr int     threads = 256;
constexpr int32_t max_experts = 1 << 12, max_experts_used = 16;
constexpr int     heads_per_block = 4;

[[maybe_unused]] unsigned grid_for(int64_t n, int64_t per_block) {
    return static_cast<unsigned>(std::max<int64_t>(1, std::min(max_grid, (n + per_block - 1) / per_block)));
}

#ifndef PEBBLE_HOST_BUILD
// Thread blocks of heads_per_block warps for `warps` warps' units of attention kernel K, at most as many as the
// GPU holds of K at once (its registers decide: about 8 a multiprocessor for the scores, 6 for the values), the
// kernel's loops taking the rest. Sized for every row of a cache (positions read on the device), a grid's
// blocks were mostly past the rows attended, each launched only to end.
template <auto K> unsigned attention_blocks(int64_t warps) {
    static const int64_t most = resident_blocks(K, warp_lanes * heads_per_block);
    return static_cast<unsigned>(std::max<int64_t>(1, std::min(most, (warps + heads_per_block - 1) / heads_per_block)));
}
#endif

// The attention of a group of sequences (attention_args each): its kernels on the stream (scores, then the
// softmax where there are no parts, values, and the parts where there are), each one launch for the group,
// or run here in turn.
pebble_status attention(const arg_group<attention_args> & g, cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream;
    if (switches().split) {
        attention_scores_kernel(g);
    } else {
        attention_scores_by_lane_kernel(g);
    }
    if (!g.a[0].parts) attention_softmax_kernel(g); // else each part's own, in the values kernel
    attention_values_kernel(g);
    if (g.a[0].parts) attention_parts_kernel(g);
    return PEBBLE_OK;
#else
    const dim3 warps(warp_lanes, heads_per_block);
    // Heads and dims are the group's; the scores' grid covers the most rows a sequence may attend (every row
    // of its cache where its position is read on the device).
    const attention_args & a = g.a[0];
    int64_t rows = 0;
    for (int32_t b = 0; b < g.n; b++) rows = std::max(rows, g.a[b].pos ? g.a[b].n_ctx : g.a[b].n_pos);
    const unsigned n = static_cast<unsigned>(g.n);
    if (switches().split) {
        LAUNCH(attention_scores_kernel, dim3(attention_blocks<attention_scores_kernel>(a.n_head_kv * rows), n), warps,
               stream, g);
    } else {
        LAUNCH(attention_scores_by_lane_kernel, dim3(grid_for(a.n_head * ((rows + warp_lanes - 1) / warp_lanes),
                                                              heads_per_block), n), warps, stream, g);
    }
    TRY(launched());
    if (!a.parts) { // else each part's own softmax, in the values kernel
        LAUNCH(attention_softmax_kernel, dim3(grid_for(a.n_head, heads_per_block), n), warps, stream, g);
        TRY(launched());
    }
    const int64_t parts = a.parts ? split_parts(rows) : 1; // every part a sequence of the group may have
    LAUNCH(attention_values_kernel, dim3(attention_blocks<attention_values_kernel>(
                                             a.n_head * parts * ((a.head_dim + warp_lanes - 1) / warp_lanes)),
                                         n), warps, stream, g);
    TRY(launched());
    if (!a.parts) return PEBBLE_OK;
    LAUNCH(attention_parts_kernel, dim3(grid_for(int64_t(a.n_head) * a.head_dim, threads), n), threads, stream, g);
    return launched();
#endif
}

// The attention of sequences 0..n-1, args(b) each one's arguments, a launch of each kernel per group.
template <typename F> pebble_status attention_in_groups(int32_t n, F && args, cudaStream_t stream) {
    const int32_t group = switches().group;
    for (int32_t first = 0; first < n; first += group) {
        arg_group<attention_args> g{}; // the entries past n zeroed: they travel with the launch
        g.n = std::min(group, n - first);
        for (int32_t b = 0; b < g.n; b++) g.a[b] = args(first + b);
        TRY(attention(g, stream));
    }
    return PEBBLE_OK;
}

// out = act(gate) * up for n elements (SiLU, or GELU's tanh approximation): the host library's SIMD loop
// split among its threads, the kernels above on the GPU.
pebble_status gate_times_up(bool gelu, const float * gate, const float * up, int64_t n, act_t * out, cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream;
    pebble_cpu::gated(gelu, gate, up, n, out);
    return PEBBLE_OK;
#else
    if (gelu) {
        LAUNCH(geglu_kernel, grid_for(n, threads), threads, stream, gate, up, n, out);
    } else {
        LAUNCH(swiglu_kernel, grid_for(n, threads), threads, stream, gate, up, n, out);
    }
    return launched();
#endif
}

uint64_t aligned(uint64_t n) { return (n + 255) / 256 * 256; }

pebble_status check_shape(const pebble_layer_shape * s, int64_t n_ctx) {
    if (!s) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "shape must not be NULL");
    if (s->n_embd < 1 || s->n_head < 1 || s->n_head_kv < 1 || s->head_dim < 1 || s->n_ff < 1 || n_ctx < 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "n_embd %d, n_head %d, n_head_kv %d, head_dim %d, "
                    "n_ff %d and n_ctx %" PRId64 " must each be at least 1", s->n_embd, s->n_head, s->n_head_kv,
                    s->head_dim, s->n_ff, n_ctx);
    }
    if (s->n_head % s->n_head_kv != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%d query heads cannot share %d KV heads evenly",
                    s->n_head, s->n_head_kv);
    }
    if (s->rope_dims < 0 || s->rope_dims > s->head_dim || s->rope_dims % 2 != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "rope_dims %d must be even and within 0..head_dim "
                    "(%d)", s->rope_dims, s->head_dim);
    }
    if (s->gelu != 0 && s->gelu != 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "gelu is %d; 0 (SwiGLU) or 1 (GELU) are accepted",
                    s->gelu);
    }
    if (s->ring != 0 && s->ring != 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "ring is %d; 0 or 1 are accepted", s->ring);
    }
    if (!(s->attn_softcap >= 0.0f) || !std::isfinite(s->attn_softcap) || !std::isfinite(s->residual_scale)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "attn_softcap %g must be finite and at least 0, "
                    "residual_scale %g finite", static_cast<double>(s->attn_softcap),
                    static_cast<double>(s->residual_scale));
    }
    if (n_ctx > INT64_MAX / 4 / s->n_head) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "n_ctx %" PRId64 " is too large", n_ctx);
    }
    if (s->n_expert < 0 || s->n_expert > max_experts || s->n_ff_shexp < 0 ||
        (s->n_expert > 0 && (s->n_expert_used < 1 || s->n_expert_used > std::min(s->n_expert, max_experts_used) ||
                             s->n_ff_exp < 1 ||
                             (s->expert_norm != 0 && s->expert_norm != 1) || !std::isfinite(s->expert_scale) ||
                             s->gelu))) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "experts: n_expert %d must be within 0..%d and, above 0, "
                    "n_expert_used %d within 1..n_expert (and %d), n_ff_exp %d at least 1, expert_norm %d 0 or 1, "
                    "expert_scale %g finite, gelu 0 (experts are SwiGLU); n_ff_shexp %d at least 0", s->n_expert,
                    max_experts, s->n_expert_used, max_experts_used, s->n_ff_exp, s->expert_norm,
                    static_cast<double>(s->expert_scale), s->n_ff_shexp);
    }
    return PEBBLE_OK;
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

pebble_status check_vector(const char * what, const pebble_tensor_ref & t, bool optional) {
    if (!t.data) {
        return optional ? PEBBLE_OK
                        : fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s must not be NULL", what);
    }
    if (t.ggml_type != f32_type && t.ggml_type != f16_type) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s has GGUF type %d (%s); vectors must be "
                    "0 F32 or 1 F16", what, t.ggml_type, ggml_type_name(t.ggml_type));
    }
    return PEBBLE_OK;
}

pebble_status check_weight(const char * what, const pebble_tensor_ref & t, int64_t rows, int64_t cols) {
    if (!t.data) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s must not be NULL", what);
    return check_matrix("weight", what, t.ggml_type, rows, cols);
}

} // namespace

// ---------------------------------------------------------------------------------------------------
// attention of a batch of sequences, one query each

namespace {

// What pebble_attend and pebble_attend_prompt both require of the heads, the caches' type and the scores
// (the counts already at least 1), named for `fn`.
pebble_status check_attention(const char * fn, int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t kv_type,
                              float scale, float softcap) {
    if (n_head % n_head_kv != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %d query heads cannot share %d KV heads evenly", fn, n_head,
                    n_head_kv);
    }
    if (!kv_known(kv_type) || (kv_blocked(kv_type) && head_dim % kv_block != 0)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: kv_type %d (%s) with head_dim %d; the caches must be 0 F32, "
                    "1 F16, or 8 Q8_0 or 2 Q4_0 where head_dim is a multiple of 32", fn, kv_type,
                    ggml_type_name(kv_type), head_dim);
    }
    if (!(softcap >= 0.0f) || !std::isfinite(softcap) || !std::isfinite(scale)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: scale %g and softcap %g must be finite, softcap at least 0", fn,
                    static_cast<double>(scale), static_cast<double>(softcap));
    }
    return PEBBLE_OK;
}

} // namespace

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
    TRY(check_attention("pebble_attend", n_head, n_head_kv, head_dim, kv_type, scale, softcap));
    // Every offset below fits in int64: q and out of n_seq x n_head x head_dim float32, each cache's rows.
    const int64_t q_width = int64_t(n_head) * head_dim, kv_row = int64_t(n_head_kv) * head_dim;
    if (q_width > INT64_MAX / 4 / n_seq || n_rows > INT64_MAX / 4 / kv_row) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_attend: %d sequences of %d x %d heads, caches of %" PRId64 " rows of "
                    "%d x %d: too large to address", n_seq, n_head, head_dim, n_rows, n_head_kv, head_dim);
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
    const int64_t kv_width = int64_t(n_head_kv) * head_dim, kv_row_bytes = kv_bytes(kv_type, kv_width);
    const int64_t width = int64_t(n_head) * head_dim;
    auto args_of = [&](int32_t b) { // sequence b's, its float32 output at out
        return attention_args{q + b * width, k_caches[b], v_caches[b], kv_type, n_head, n_head_kv, head_dim, n_pos[b],
                              n_rows, scale, softcap, static_cast<float *>(scratch) + int64_t(b) * n_head * n_rows,
                              nullptr, out + b * width, nullptr, nullptr}; // V summed in one pass
    };
#ifdef PEBBLE_HOST_BUILD
    (void)stream_ptr;
    for (int32_t b = 0; k_new && b < n_seq; b++) {
        const int64_t at = (n_pos[b] - 1) * kv_row_bytes;
        store_row_kernel(k_new + b * kv_width, static_cast<uint8_t *>(k_caches[b]) + at, kv_type, kv_width);
        store_row_kernel(v_new + b * kv_width, static_cast<uint8_t *>(v_caches[b]) + at, kv_type, kv_width);
    }
    if (host_runs_gpu_kernels()) return attention_in_groups(n_seq, args_of, nullptr); // the GPU's kernels
    return pebble_cpu::attend(n_seq, q, kv_type, k_caches, v_caches, n_pos, n_rows, n_head, n_head_kv,
                              head_dim, scale, softcap, out, static_cast<float *>(scratch));
#else
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    if (k_new) {
        TRY(check_device_pointer(k_new, "k_new", "pebble_attend"));
        TRY(check_device_pointer(v_new, "v_new", "pebble_attend"));
    }
    for (int32_t b = 0; b < n_seq; b++) {
        TRY(check_device_pointer(k_caches[b], "k_caches[b]", "pebble_attend"));
        TRY(check_device_pointer(v_caches[b], "v_caches[b]", "pebble_attend"));
        if (k_new) {
            const int64_t at = (n_pos[b] - 1) * kv_row_bytes;
            const int64_t units = kv_units(kv_type, kv_width);
            LAUNCH(store_row_kernel, grid_for(units, threads), threads, stream, k_new + b * kv_width,
                   static_cast<uint8_t *>(k_caches[b]) + at, kv_type, kv_width);
            LAUNCH(store_row_kernel, grid_for(units, threads), threads, stream, v_new + b * kv_width,
                   static_cast<uint8_t *>(v_caches[b]) + at, kv_type, kv_width);
        }
    }
    return attention_in_groups(n_seq, args_of, stream);
#endif
}

extern "C" pebble_status pebble_attend_prompt(const float * q, int64_t n_tok, int64_t pos, int32_t kv_type,
                                              const void * k_cache, const void * v_cache, int64_t n_rows, int32_t n_head,
                                              int32_t n_head_kv, int32_t head_dim, int64_t window, float scale,
                                              float softcap, float * out, void * stream_ptr) {
    if (!q || !k_cache || !v_cache || !out) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend_prompt: q, k_cache, v_cache and out must not be NULL");
    }
    if (n_tok < 1 || n_head < 1 || n_head_kv < 1 || head_dim < 1 || pos < 0 || window < 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend_prompt: n_tok %" PRId64 ", n_head %d, n_head_kv %d and "
                    "head_dim %d must each be at least 1, pos %" PRId64 " and window %" PRId64 " at least 0", n_tok,
                    n_head, n_head_kv, head_dim, pos, window);
    }
    TRY(check_attention("pebble_attend_prompt", n_head, n_head_kv, head_dim, kv_type, scale, softcap));
    const int64_t kv_row = int64_t(n_head_kv) * head_dim, q_width = int64_t(n_head) * head_dim;
    if (n_rows > INT64_MAX / 4 / kv_row || n_tok > INT64_MAX / 4 / q_width) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_attend_prompt: %" PRId64 " queries of %d x %d, caches of %" PRId64
                    " rows of %d x %d: too large to address", n_tok, n_head, head_dim, n_rows, n_head_kv, head_dim);
    }
    if (pos > n_rows - n_tok) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_attend_prompt: queries at positions %" PRId64 "..%" PRId64
                    " need that many cache rows; the caches hold %" PRId64, pos, pos + n_tok - 1, n_rows);
    }
#ifdef PEBBLE_HOST_BUILD
    (void)stream_ptr;
    return pebble_cpu::attend_prompt(q, n_tok, pos, kv_type, k_cache, v_cache, n_head, n_head_kv, head_dim, window,
                                     scale, softcap, out);
#else
    (void)stream_ptr;
    return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend_prompt: the cuda library does not attend prompts yet; "
                "attend them with array operations on the device (the host library has this call)");
#endif
}

// ---------------------------------------------------------------------------------------------------
// the decode step of a whole model (pebble_decoder_*)

namespace {

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

// rms_rows_kernel over n rows of e values, normed by w: one launch.
pebble_status norm_rows(const float * x, int64_t n, int64_t e, const pebble_tensor_ref & w, float eps, act_t * out,
                        [[maybe_unused]] cudaStream_t stream) {
    LAUNCH(rms_rows_kernel, grid_for(n, 1), norm_threads, stream, x, n, e, w.data, w.ggml_type, eps, out);
    return launched();
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


// logits *= scale, then c * tanh(l / c) where cap > 0
__global__ void logits_kernel(float * __restrict__ y, int64_t n, float scale, float cap) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) {
        float l = scale == 1.0f ? y[i] : y[i] * scale;
        if (cap > 0.0f) l = tanhf(l / cap) * cap;
        y[i] = l;
    }
}


struct step_scratch {
    uint64_t h16, q, k, v, q_rot, kv_new, scores, parts, o, gate, up, pos, x, logits, bytes;
    uint64_t router, rows, act, y;  // experts: the router's scores, the gathered rows, the gated FFN, its out
};

// When a step is run as a CUDA graph. A step's launches depend on its batch (which sequences, in which
// order) and on whether it makes logits; positions are read from device memory and the hidden states and
// logits pass through the decoder's own buffers, so that a graph captured once replays for every later
// step of the same batch. A batch seen twice running is captured; one that has a graph replays it; any
// other runs directly (its launches enqueued one by one). Up to graph_slots graphs are kept, the least
// recently used dropped first. The host build makes the same decisions and counts them; it has no graphs,
// so it runs every step directly.
constexpr int graph_slots = PEBBLE_DECODER_GRAPHS;

struct step_key {
    int32_t n = 0;
    bool    logits = false;
    int32_t seqs[PEBBLE_DECODER_MAX_BATCH] = {};

    bool operator==(const step_key & o) const {
        return n == o.n && logits == o.logits && std::equal(seqs, seqs + n, o.seqs);
    }
};

enum class step_mode { direct, capture, replay };

struct graph_policy {
    bool     enabled = false;
    bool     seen_once = false;  // last_direct holds the last step run directly
    step_key last_direct;
    struct slot {
        bool     used = false;
        step_key key;
        uint64_t last_use = 0;
#ifndef PEBBLE_HOST_BUILD
        cudaGraphExec_t exec = nullptr;
#endif
    } slots[graph_slots];
    uint64_t clock = 0;
    uint64_t captured = 0, replays = 0, dropped = 0;

    // What to do with a step of this key; *at is the slot to replay or capture into.
    step_mode decide(const step_key & k, int * at) {
        clock++;
        if (!enabled) return step_mode::direct;
        for (int i = 0; i < graph_slots; i++) {
            if (slots[i].used && slots[i].key == k) {
                slots[i].last_use = clock;
                replays++;
                *at = i;
                return step_mode::replay;
            }
        }
        if (seen_once && last_direct == k) {
            int victim = 0;
            for (int i = 0; i < graph_slots; i++) {
                if (!slots[i].used) {
                    victim = i;
                    break;
                }
                if (slots[i].last_use < slots[victim].last_use) victim = i;
            }
            if (slots[victim].used) drop(victim);
            seen_once = false;
            *at = victim;
            return step_mode::capture;
        }
        last_direct = k;
        seen_once = true;
        return step_mode::direct;
    }

    // The capture into slot i succeeded: its key replays from now on.
    void keep(int i, const step_key & k) {
        slots[i].used = true;
        slots[i].key = k;
        slots[i].last_use = clock;
        captured++;
    }

    void drop(int i) {
#ifndef PEBBLE_HOST_BUILD
        if (slots[i].exec) cudaGraphExecDestroy(slots[i].exec);
        slots[i].exec = nullptr;
#endif
        slots[i].used = false;
        dropped++;
    }

    // Graphs cannot be made here (a capture or an instantiation failed): every step runs directly.
    void give_up() {
        for (int i = 0; i < graph_slots; i++) {
            if (slots[i].used) drop(i);
        }
        enabled = false;
    }
};

} // namespace

struct pebble_decoder {
    pebble_step_model model{};
    std::vector<pebble_step_layer> layers;
    std::vector<void *> k, v;          // [layer * n_seq + s]
    step_scratch at{};
    int64_t widest = 0, max_q = 0, max_kv = 0, max_ff = 0, max_heads = 0, max_rows = 0, max_expert = 0;
    int64_t parts_per_seq = 0; // floats of a sequence's attention parts (attention_args.parts)
    std::vector<float> router_host;    // the router's scores of a step, read back
    std::vector<float> router_p;       // one token's expert probabilities, and the experts by them (kept, so
    std::vector<int32_t> router_order; // that a step allocates nothing)
    // experts as pebbles (pebble_step_model's expert_policy): slots of one expert each in one buffer; per
    // layer its cache's slots, the expert each holds (-1: none), when it was last used, and how often the
    // step ran each expert of the layer; the staging slots, each free (layer -1) or holding a guess for
    // (layer, expert) not yet run; the guesses of the layer about to run and, while a layer of experts
    // runs, which of its experts the step has still to run.
    struct expert_cache {
        uint64_t part_bytes[3] = {}, nbytes = 0; // an expert's gate, up and down rows; their sum
        std::vector<uint8_t *> slot;
        std::vector<int32_t>   expert;
        std::vector<uint64_t>  used;
        std::vector<uint64_t>  uses;
    };
    struct staged {
        uint8_t * slot = nullptr;
        int32_t   layer = -1, expert = -1;
    };
    std::vector<expert_cache> experts;
    std::vector<staged> staging;
    std::vector<int32_t> guessed;
    std::vector<uint8_t> to_run;
    std::vector<float> guess_score;
    uint8_t * expert_buffer = nullptr;
    uint64_t expert_clock = 0;
    uint8_t * scratch = nullptr;
    graph_policy graphs;
    // streamed layers (pebble_step_layer.streamed): their order, and per layer where each weight and each
    // sequence's caches lie in its slot (the n-th streamed layer's is slot n % 2)
    std::vector<int32_t> streamed;                 // layer of the n-th streamed layer
    std::vector<int32_t> stream_order;             // per layer: n, or -1 where resident
    std::vector<std::array<uint64_t, PEBBLE_LAYER_WEIGHTS>> weight_bytes; // per layer and field: entry size
    uint8_t * slots[2] = {nullptr, nullptr};         // made here (freed with the decoder) ...
    uint8_t * slots_given[2] = {nullptr, nullptr};   // ... or the caller's
    uint64_t  slot_bytes = 0;
#ifndef PEBBLE_HOST_BUILD
    cudaStream_t copy = nullptr;       // the slots' copies
    cudaEvent_t  slot_ready[2] = {nullptr, nullptr}, slot_free[2] = {nullptr, nullptr}, copied = nullptr;
#endif
#ifndef PEBBLE_HOST_BUILD
    int64_t *    pos_host = nullptr;   // pinned: the positions a step (or its graph) copies to the device
    cudaStream_t own = nullptr;        // where steps run and graphs are captured (never the legacy stream)
    cudaEvent_t  ready = nullptr, done = nullptr;
#endif
    std::mutex lock;                   // one step at a time
    struct pebble_decoder_stats stats{};
};

namespace {

// The last failure's message again, after `where` (the message is copied first: fail writes the same buffer).
pebble_status with_place(pebble_status st, const char * where) {
    char message[512];
    snprintf(message, sizeof message, "%s", pebble_last_error());
    return fail(st, "%s: %s", where, message);
}

pebble_status check_layer(const char * fn, int32_t i, const pebble_layer_shape & s, const pebble_layer_weights & w,
                          int64_t kv_rows, bool experts_stored) {
    // Which layer failed is added to the message of the layer's own checks here.
    char where[64];
    snprintf(where, sizeof where, "%s: layer %d", fn, i);
    pebble_status st = check_shape(&s, kv_rows);
    if (st != PEBBLE_OK) return with_place(st, where);
    const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
    const struct { const char * name; const pebble_tensor_ref & t; bool optional; } vectors[] = {
        {"attn_norm", w.attn_norm, false}, {"ffn_norm", w.ffn_norm, false}, {"bq", w.bq, true}, {"bk", w.bk, true},
        {"bv", w.bv, true}, {"q_norm", w.q_norm, true}, {"k_norm", w.k_norm, true},
        {"post_attn_norm", w.post_attn_norm, true}, {"post_ffn_norm", w.post_ffn_norm, true}};
    for (const auto & vec : vectors) {
        if ((st = check_vector(vec.name, vec.t, vec.optional)) != PEBBLE_OK) {
            return with_place(st, where);
        }
    }
    if ((w.q_norm.data || w.k_norm.data) && (w.bq.data || w.bk.data)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: Q/K norms together with Q/K biases are not supported", where);
    }
    const int64_t E = s.n_expert, ff = s.n_expert ? s.n_ff_exp : s.n_ff, sh = s.n_ff_shexp;
    const bool moe = E > 0, shared = moe && sh > 0;
    const struct { const char * name; const pebble_tensor_ref & t; int64_t rows, cols; bool wanted; } matrices[] = {
        {"wq", w.wq, q, e, true}, {"wk", w.wk, kv, e, true}, {"wv", w.wv, kv, e, true}, {"wo", w.wo, e, q, true},
        {"w_gate", w.w_gate, ff, e, !moe}, {"w_up", w.w_up, ff, e, !moe}, {"w_down", w.w_down, e, ff, !moe},
        {"ffn_gate_inp", w.ffn_gate_inp, E, e, moe}, {"ffn_gate_exps", w.ffn_gate_exps, E * ff, e, moe},
        {"ffn_up_exps", w.ffn_up_exps, E * ff, e, moe}, {"ffn_down_exps", w.ffn_down_exps, E * e, ff, moe},
        {"ffn_gate_shexp", w.ffn_gate_shexp, sh, e, shared}, {"ffn_up_shexp", w.ffn_up_shexp, sh, e, shared},
        {"ffn_down_shexp", w.ffn_down_shexp, e, sh, shared}};
    for (const auto & m : matrices) {
        if (!m.wanted && m.t.data) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s is given but the shape (n_expert %d, n_ff_shexp %d) has "
                        "no use for it", where, m.name, s.n_expert, s.n_ff_shexp);
        }
        const bool stored = experts_stored && (&m.t == &w.ffn_gate_exps || &m.t == &w.ffn_up_exps ||
                                               &m.t == &w.ffn_down_exps);  // entries of the store: types only
        if (m.wanted && (st = stored ? check_matrix("weight", m.name, m.t.ggml_type, m.rows, m.cols)
                                     : check_weight(m.name, m.t, m.rows, m.cols)) != PEBBLE_OK) {
            return with_place(st, where);
        }
    }
    if ((st = check_vector("ffn_gate_inp_shexp", w.ffn_gate_inp_shexp, !shared)) != PEBBLE_OK) {
        return with_place(st, where);
    }
    if (!shared && w.ffn_gate_inp_shexp.data) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: ffn_gate_inp_shexp is given but the layer has no shared "
                    "expert (n_ff_shexp %d)", where, s.n_ff_shexp);
    }
    return PEBBLE_OK;
}

pebble_status alloc_scratch(uint8_t ** out, uint64_t bytes) {
#ifdef PEBBLE_HOST_BUILD
    *out = static_cast<uint8_t *>(std::malloc(bytes));
    if (!*out) return fail(PEBBLE_ERR_HOST_OOM, "pebble_decoder_create: no memory for %" PRIu64 " bytes of scratch", bytes);
#else
    void * p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_DEVICE_OOM, "pebble_decoder_create: no device memory for %" PRIu64 " bytes of scratch",
                    bytes);
    }
    *out = static_cast<uint8_t *>(p);
#endif
    return PEBBLE_OK;
}

void free_scratch(uint8_t * p) {
#ifdef PEBBLE_HOST_BUILD
    std::free(p);
#else
    if (p) cudaFree(p);
#endif
}

template <typename T> T * at_offset(uint8_t * base, uint64_t offset) { return reinterpret_cast<T *>(base + offset); }

// out[r] = 0 for r < n
__global__ void zero_kernel(float * __restrict__ out, int64_t n) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) out[i] = 0.0f;
}

// One warp per token: out[b] += y[b] * sigmoid(h[b] . g) (the shared expert's gate, qwen2moe).
__global__ void shared_gate_kernel(float * __restrict__ out, const float * __restrict__ y, const act_t * __restrict__ h,
                                   int64_t n_rows, int64_t e, const void * g, int32_t g_type) {
    for (int64_t r = grid_warp(); r < n_rows; r += grid_warps()) {
        float dot = 0.0f;
        for (int64_t i = warp_lane(); i < e; i += warp_lanes) dot += act_value(h, r * e + i) * load_value(g, g_type, i);
        dot = warp_sum(dot);
        const float gate = 1.0f / (1.0f + expf(-dot));
        for (int64_t i = warp_lane(); i < e; i += warp_lanes) out[r * e + i] += y[r * e + i] * gate;
    }
}

uint64_t row_bytes(int32_t type, int64_t cols) {
    int64_t elements = 1, block = 0;
    type_block(type, &elements, &block);
    return uint64_t(cols / elements) * uint64_t(block);
}

pebble_store_t expert_store(const pebble_decoder & d) {
    return d.model.expert_store ? d.model.expert_store : d.model.store;
}

// The victim of layer i's cache (it has slots): an empty slot, else among the experts the step does not
// still have to run (all of them where it has to run every one) the least recently used, or with
// expert_policy 1 the least often run (ties to the least recently used).
size_t cache_victim(const pebble_decoder & d, const pebble_decoder::expert_cache & c) {
    size_t victim = 0;
    for (size_t k = 0; k < c.expert.size(); k++) {
        if (c.expert[k] < 0) return k;
        const bool needed = d.to_run[size_t(c.expert[k])] != 0, victim_needed = d.to_run[size_t(c.expert[victim])] != 0;
        if (needed != victim_needed) {
            if (!needed) victim = k;
            continue;
        }
        const uint64_t uk = c.uses[size_t(c.expert[k])], uv = c.uses[size_t(c.expert[victim])];
        const bool older = c.used[k] < c.used[victim];
        if (d.model.expert_policy == 1 ? (uk < uv || (uk == uv && older)) : older) victim = k;
    }
    return victim;
}

// A staging slot for a miss of layer i, which has no cache: a free one, else one holding a guess the layer
// does not run, else the guess still to run of the highest expert index.
size_t staging_victim(const pebble_decoder & d, int32_t i) {
    size_t pick = 0;
    int32_t pick_expert = -1;
    for (size_t k = 0; k < d.staging.size(); k++) {
        const pebble_decoder::staged & g = d.staging[k];
        if (g.layer != i || !d.to_run[size_t(g.expert)]) return k;
        if (g.expert > pick_expert) {
            pick = k;
            pick_expert = g.expert;
        }
    }
    return pick;
}

// The entries of the merged expert tensors (experts_stored 2): weight_ids of ffn_gate_exps, ffn_up_exps and
// ffn_down_exps, in the order of an expert's slot.
constexpr int merged_expert_fields[3] = {17, 18, 19};

// Whether a streamed layer's slot takes field f of its weights: the entries it names, but not the merged
// experts it reads expert by expert (experts_stored 2).
bool streams_field(const pebble_step_layer & L, int f) {
    if (L.weight_ids[f] < 0) return false;
    return L.experts_stored != 2 || (f != merged_expert_fields[0] && f != merged_expert_fields[1] &&
                                     f != merged_expert_fields[2]);
}

pebble_status restore_expert(pebble_decoder & d, int32_t i, int32_t j, uint8_t * slot, cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_decoder::expert_cache & c = d.experts[size_t(i)];
    const uint64_t nbytes = c.nbytes;
    pebble_status st = PEBBLE_OK;
    if (L.experts_stored == 2) { // the j-th n_expert-th of each merged tensor, one after another
        uint64_t at = 0;
        for (int m = 0; m < 3 && st == PEBBLE_OK; at += c.part_bytes[m], m++) {
            st = pebble_read(d.model.store, i, L.weight_ids[merged_expert_fields[m]], uint64_t(j) * c.part_bytes[m],
                             slot + at, c.part_bytes[m], stream);
        }
    } else {
        st = pebble_restore(expert_store(d), i, L.expert_ids + j, slot, nbytes, stream);
    }
    if (st != PEBBLE_OK) {
        char where[96];
        snprintf(where, sizeof where, "pebble_decoder_step: layer %d: expert %d", i, j);
        return with_place(st, where);
    }
    d.stats.expert_bytes_restored += nbytes;
    return PEBBLE_OK;
}

// Expert j of layer i where the step runs it: a hit where the layer's cache holds it or a guess brought it
// to a staging slot (taken into the cache, where the layer has one), else restored (on `stream`, so after
// whatever read the slot before) into the cache's victim or a staging slot.
pebble_status cached_expert(pebble_decoder & d, int32_t i, int32_t j, cudaStream_t stream, uint8_t ** out) {
    pebble_decoder::expert_cache & c = d.experts[size_t(i)];
    const uint64_t now = ++d.expert_clock;
    c.uses[size_t(j)]++;
    d.to_run[size_t(j)] = 0;
    for (size_t k = 0; k < c.expert.size(); k++) {
        if (c.expert[k] == j) {
            c.used[k] = now;
            d.stats.expert_hits++;
            *out = c.slot[k];
            return PEBBLE_OK;
        }
    }
    for (pebble_decoder::staged & g : d.staging) {
        if (g.layer != i || g.expert != j) continue;
        d.stats.expert_hits++;
        d.stats.expert_prefetch_hits++;
        g.layer = g.expert = -1;
        if (c.slot.empty()) {
            *out = g.slot;  // free again: the next restore into it is ordered after this expert's FFN
            return PEBBLE_OK;
        }
        const size_t v = cache_victim(d, c);
        std::swap(c.slot[v], g.slot);
        c.expert[v] = j;
        c.used[v] = now;
        *out = c.slot[v];
        return PEBBLE_OK;
    }
    uint8_t * slot;
    if (c.slot.empty()) {
        pebble_decoder::staged & g = d.staging[staging_victim(d, i)];
        g.layer = g.expert = -1;
        slot = g.slot;
    } else {
        const size_t v = cache_victim(d, c);
        c.expert[v] = -1;
        slot = c.slot[v];
        TRY(restore_expert(d, i, j, slot, stream));
        c.expert[v] = j;
        c.used[v] = now;
        d.stats.expert_misses++;
        *out = slot;
        return PEBBLE_OK;
    }
    TRY(restore_expert(d, i, j, slot, stream));
    d.stats.expert_misses++;
    *out = slot;
    return PEBBLE_OK;
}

// Prefetch for layer i (pebble_step_model.expert_prefetch): its router applied to x [n][n_embd], the hidden
// state entering it, RMS-normed with its ffn_norm; the n_expert_used experts of the highest probability
// summed over the n tokens guessed, and each one the layer's cache lacks restored into a staging slot.
pebble_status prefetch_experts(pebble_decoder & d, int32_t i, int32_t n, const float * x, cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_layer_shape & s = L.shape;
    const int64_t e = s.n_embd, E = s.n_expert;
    act_t * h16 = at_offset<act_t>(d.scratch, d.at.h16);
    float * router = at_offset<float>(d.scratch, d.at.router);
    TRY(norm_rows(x, n, e, L.weights.ffn_norm, s.rms_eps, h16, stream));
    TRY(matvec_many(L.weights.ffn_gate_inp.ggml_type, L.weights.ffn_gate_inp.data, E, e, h16, n, router, stream));
    CUDA_CHECK(cudaMemcpyAsync(d.router_host.data(), router, sizeof(float) * size_t(n) * size_t(E), cudaMemcpyDefault,
                               stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> & score = d.guess_score;
    std::vector<int32_t> & order = d.router_order;
    std::fill(score.begin(), score.begin() + E, 0.0f);
    for (int32_t b = 0; b < n; b++) {
        const float * sc = d.router_host.data() + size_t(b) * size_t(E);
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < E; j++) top = std::max(top, sc[j]);
        for (int64_t j = 0; j < E; j++) total += expf(sc[j] - top);
        for (int64_t j = 0; j < E; j++) score[size_t(j)] += expf(sc[j] - top) / total;
    }
    for (int64_t j = 0; j < E; j++) order[size_t(j)] = static_cast<int32_t>(j);
    const int32_t k = s.n_expert_used;
    std::partial_sort(order.begin(), order.begin() + k, order.begin() + E, [&score](int32_t a, int32_t c) {
        return score[size_t(a)] > score[size_t(c)] || (score[size_t(a)] == score[size_t(c)] && a < c);
    });
    std::sort(order.begin(), order.begin() + k);
    const pebble_decoder::expert_cache & c = d.experts[size_t(i)];
    d.guessed.assign(order.begin(), order.begin() + k);
    for (pebble_decoder::staged & g : d.staging) g.layer = g.expert = -1;  // (a failed step may have left some)
    size_t free_slot = 0;
    for (int32_t g : d.guessed) {
        d.stats.expert_guesses++;
        if (std::find(c.expert.begin(), c.expert.end(), g) != c.expert.end()) continue;  // cached: nothing to move
        pebble_decoder::staged & slot = d.staging[free_slot++];
        TRY(restore_expert(d, i, g, slot.slot, stream));
        slot.layer = i;
        slot.expert = g;
        d.stats.expert_prefetches++;
    }
    return PEBBLE_OK;
}

// The routed FFN of the n rows of h (normed) into out [n][n_embd] float32 (pebble_layer_shape's experts):
// the router's scores are read back, each token's experts chosen on the host, then expert by expert in
// increasing order the rows routed to it are gathered, run through its gate, up and down (its rows read
// once for all of them) and added, weighted, to their tokens' out; the shared expert after, where given.
pebble_status experts_ffn(pebble_decoder & d, int32_t layer, int32_t n, const act_t * h, float * out,
                          cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(layer)];
    const pebble_layer_shape & s = L.shape;
    const pebble_layer_weights & w = L.weights;
    const int64_t e = s.n_embd, E = s.n_expert, ff = s.n_ff_exp;
    const int32_t k = s.n_expert_used;
    float * router = at_offset<float>(d.scratch, d.at.router), * y = at_offset<float>(d.scratch, d.at.y);
    float * gate = at_offset<float>(d.scratch, d.at.gate), * up = at_offset<float>(d.scratch, d.at.up);
    act_t * rows = at_offset<act_t>(d.scratch, d.at.rows), * act = at_offset<act_t>(d.scratch, d.at.act);
    TRY(matvec_many(w.ffn_gate_inp.ggml_type, w.ffn_gate_inp.data, E, e, h, n, router, stream));
    CUDA_CHECK(cudaMemcpyAsync(d.router_host.data(), router, sizeof(float) * size_t(n) * size_t(E), cudaMemcpyDefault,
                               stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    // per token: its experts (a softmax over all, the k most probable, ties to the lower index) and weights
    int32_t chosen[PEBBLE_DECODER_MAX_BATCH][max_experts_used];
    float weight[PEBBLE_DECODER_MAX_BATCH][max_experts_used];
    std::vector<int32_t> & order = d.router_order;
    std::vector<float> & p = d.router_p;
    for (int32_t b = 0; b < n; b++) {
        const float * sc = d.router_host.data() + size_t(b) * size_t(E);
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < E; j++) top = std::max(top, sc[j]);
        for (int64_t j = 0; j < E; j++) total += (p[size_t(j)] = expf(sc[j] - top));
        for (int64_t j = 0; j < E; j++) {
            p[size_t(j)] /= total;
            order[size_t(j)] = static_cast<int32_t>(j);
        }
        std::partial_sort(order.begin(), order.begin() + k, order.begin() + E, [&p](int32_t a, int32_t c) {
            return p[size_t(a)] > p[size_t(c)] || (p[size_t(a)] == p[size_t(c)] && a < c);
        });
        float sum = 0.0f;
        for (int32_t r = 0; r < k; r++) sum += p[size_t(order[size_t(r)])];
        for (int32_t r = 0; r < k; r++) {
            chosen[b][r] = order[size_t(r)];
            float wr = p[size_t(order[size_t(r)])];
            if (s.expert_norm) wr = wr / sum;
            weight[b][r] = s.expert_scale == 1.0f ? wr : wr * s.expert_scale;
        }
    }
    if (L.experts_stored) {  // what the step has to run, and how many of the layer's guesses it runs
        std::fill(d.to_run.begin(), d.to_run.begin() + E, uint8_t(0));
        for (int32_t b = 0; b < n; b++) {
            for (int32_t r = 0; r < k; r++) d.to_run[size_t(chosen[b][r])] = 1;
        }
        for (int32_t g : d.guessed) d.stats.expert_guesses_right += d.to_run[size_t(g)];
        d.guessed.clear();
    }
    LAUNCH(zero_kernel, grid_for(int64_t(n) * e, threads), threads, stream, out, int64_t(n) * e);
    TRY(launched());
    const uint64_t gate_rows = row_bytes(w.ffn_gate_exps.ggml_type, e) * uint64_t(ff);
    const uint64_t up_rows = row_bytes(w.ffn_up_exps.ggml_type, e) * uint64_t(ff);
    const uint64_t down_rows = row_bytes(w.ffn_down_exps.ggml_type, ff) * uint64_t(e);
    for (int64_t j = 0; j < E; j++) {
        int32_t tokens[PEBBLE_DECODER_MAX_BATCH];
        float weights[PEBBLE_DECODER_MAX_BATCH];
        int32_t c = 0;
        for (int32_t b = 0; b < n; b++) {
            for (int32_t r = 0; r < k; r++) {
                if (chosen[b][r] == j) {
                    tokens[c] = b;
                    weights[c++] = weight[b][r];
                }
            }
        }
        if (c == 0) continue;
        for (int32_t r = 0; r < c; r++) {
            CUDA_CHECK(cudaMemcpyAsync(rows + int64_t(r) * e, h + int64_t(tokens[r]) * e, sizeof(act_t) * size_t(e),
                                       cudaMemcpyDefault, stream));
        }
        const uint8_t * g, * u, * dn;
        if (L.experts_stored) {  // from the layer's cache, restored first where it lacks the expert
            uint8_t * slot = nullptr;
            TRY(cached_expert(d, layer, static_cast<int32_t>(j), stream, &slot));
            g = slot;
            u = slot + gate_rows;
            dn = slot + gate_rows + up_rows;
        } else {
            g = static_cast<const uint8_t *>(w.ffn_gate_exps.data) + uint64_t(j) * gate_rows;
            u = static_cast<const uint8_t *>(w.ffn_up_exps.data) + uint64_t(j) * up_rows;
            dn = static_cast<const uint8_t *>(w.ffn_down_exps.data) + uint64_t(j) * down_rows;
        }
        TRY(matvec_many(w.ffn_gate_exps.ggml_type, g, ff, e, rows, c, gate, stream));
        TRY(matvec_many(w.ffn_up_exps.ggml_type, u, ff, e, rows, c, up, stream));
        TRY(gate_times_up(false, gate, up, int64_t(c) * ff, act, stream));
        TRY(matvec_many(w.ffn_down_exps.ggml_type, dn, e, ff, act, c, y, stream));
        for (int32_t r = 0; r < c; r++) {
            LAUNCH(add_kernel, grid_for(e, threads), threads, stream, out + int64_t(tokens[r]) * e, y + int64_t(r) * e, e,
                   weights[r]);
            TRY(launched());
        }
    }
    for (pebble_decoder::staged & g : d.staging) {  // guesses the layer did not run: free again
        if (g.layer == layer) g.layer = g.expert = -1;
    }
    if (s.n_ff_shexp > 0) {
        const int64_t sh = s.n_ff_shexp;
        TRY(matvec_many(w.ffn_gate_shexp.ggml_type, w.ffn_gate_shexp.data, sh, e, h, n, gate, stream));
        TRY(matvec_many(w.ffn_up_shexp.ggml_type, w.ffn_up_shexp.data, sh, e, h, n, up, stream));
        TRY(gate_times_up(false, gate, up, int64_t(n) * sh, act, stream));
        TRY(matvec_many(w.ffn_down_shexp.ggml_type, w.ffn_down_shexp.data, e, sh, act, n, y, stream));
        LAUNCH(shared_gate_kernel, grid_for(n, heads_per_block), dim3(warp_lanes, heads_per_block), stream, out, y, h, n,
               e, w.ffn_gate_inp_shexp.data, w.ffn_gate_inp_shexp.ggml_type);
        TRY(launched());
    }
    return PEBBLE_OK;
}

// One layer for the n tokens of a step (the arguments checked).
pebble_status step_layer(pebble_decoder & d, int32_t i, int32_t n, const int32_t * seqs,
                         [[maybe_unused]] const int64_t * host_pos, float * x, cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_layer_shape & s = L.shape;
    const pebble_layer_weights & w = L.weights;
    const int32_t kv_type = d.model.kv_type, n_seq = d.model.n_seq;
    const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
    act_t * h16 = at_offset<act_t>(d.scratch, d.at.h16);
    float * fq = at_offset<float>(d.scratch, d.at.q), * fk = at_offset<float>(d.scratch, d.at.k);
    float * fv = at_offset<float>(d.scratch, d.at.v), * q_rot = at_offset<float>(d.scratch, d.at.q_rot);
    float * scores = at_offset<float>(d.scratch, d.at.scores), * o = at_offset<float>(d.scratch, d.at.o);
    float * gate = at_offset<float>(d.scratch, d.at.gate), * up = at_offset<float>(d.scratch, d.at.up);
    float * k_new = at_offset<float>(d.scratch, d.at.kv_new), * v_new = k_new + int64_t(n) * kv;
    float * parts = switches().split ? at_offset<float>(d.scratch, d.at.parts) : nullptr;

    // attention
    TRY(norm_rows(x, n, e, w.attn_norm, s.rms_eps, h16, stream));
    const matvec_part qkv[3] = {{w.wq.ggml_type, w.wq.data, q, fq}, {w.wk.ggml_type, w.wk.data, kv, fk},
                                {w.wv.ggml_type, w.wv.data, kv, fv}};
    TRY(matvec_parts(qkv, 3, e, h16, n, stream));
    if (w.q_norm.data) {
        LAUNCH(head_norm_kernel, grid_for(int64_t(n) * s.n_head, heads_per_block), dim3(warp_lanes, heads_per_block),
               stream, fq, n * s.n_head, s.head_dim, w.q_norm.data, w.q_norm.ggml_type, s.rms_eps);
        TRY(launched());
    }
    if (w.k_norm.data) {
        LAUNCH(head_norm_kernel, grid_for(int64_t(n) * s.n_head_kv, heads_per_block), dim3(warp_lanes, heads_per_block),
               stream, fk, n * s.n_head_kv, s.head_dim, w.k_norm.data, w.k_norm.ggml_type, s.rms_eps);
        TRY(launched());
    }
    void * k_of[PEBBLE_DECODER_MAX_BATCH], * v_of[PEBBLE_DECODER_MAX_BATCH];
    const int64_t * dev_pos = at_offset<int64_t>(d.scratch, d.at.pos); // the step's positions, on the device
    for (int32_t b = 0; b < n; b++) {
        k_of[b] = d.k[size_t(i) * n_seq + seqs[b]];
        v_of[b] = d.v[size_t(i) * n_seq + seqs[b]];
    }
    auto qkv_of = [&](int64_t b) {
        return qkv_args{fq + b * q, fk + b * kv, fv + b * kv, w.bq, w.bk, w.bv, static_cast<int32_t>(q),
                        static_cast<int32_t>(kv), s.head_dim, s.rope_dims, s.rope_neox, L.rope_cos,
                        L.rope_sin, dev_pos + b, q_rot + b * q, k_new + b * kv, v_new + b * kv};
    };
    auto kv_row_of = [&](int64_t b) {
        return kv_row_args{k_new + b * kv, v_new + b * kv, k_of[b], v_of[b], kv_type, kv, dev_pos + b, L.kv_rows, s.ring};
    };
#ifdef PEBBLE_HOST_BUILD
    // The sequences' biases, RoPE and new cache rows among the pool's threads (a few microseconds each);
    // through the GPU's own kernel, the same bits, where host_runs_gpu_kernels.
    const bool portable = host_runs_gpu_kernels();
    pebble_cpu::parallel_for(n, int64_t(n) * (q + 2 * kv) * qkv_work_per_value, [&](int64_t first, int64_t end) {
        for (int64_t b = first; b < end; b++) {
            if (portable) {
                arg_group<qkv_args> one{};
                one.n = 1;
                one.a[0] = qkv_of(b);
                qkv_kernel(one);
            } else {
                qkv_rows(qkv_of(b));
            }
            kv_row(kv_row_of(b));
        }
    });
#else
    const int32_t group = switches().group;
    for (int32_t first = 0; first < n; first += group) { // the sequences in groups, a launch each
        arg_group<qkv_args> qg{};
        arg_group<kv_row_args> kg{};
        qg.n = kg.n = std::min(group, n - first);
        for (int32_t b = 0; b < qg.n; b++) {
            qg.a[b] = qkv_of(first + b);
            kg.a[b] = kv_row_of(first + b);
        }
        LAUNCH(qkv_kernel, dim3(grid_for(q + 2 * kv, threads), unsigned(qg.n)), threads, stream, qg);
        TRY(launched());
        LAUNCH(kv_row_kernel, dim3(grid_for(2 * kv_units(kv_type, kv), threads), unsigned(kg.n)), threads, stream, kg);
        TRY(launched());
    }
#endif
    auto attention_of = [&](int32_t b) { // act_t is float on the host: its rows go to out_f32 there
        return attention_args{q_rot + b * q, k_of[b], v_of[b], kv_type, s.n_head, s.n_head_kv, s.head_dim, 0,
                              L.kv_rows, L.attn_scale, s.attn_softcap, scores + int64_t(b) * s.n_head * L.kv_rows,
#ifdef PEBBLE_HOST_BUILD
                              nullptr, h16 + b * q,
#else
                              h16 + b * q, nullptr,
#endif
                              dev_pos + b, parts ? parts + b * d.parts_per_seq : nullptr};
    };
#ifdef PEBBLE_HOST_BUILD
    if (portable) { // the GPU's kernels (attention)
        TRY(attention_in_groups(n, attention_of, stream));
    } else {
        int64_t n_pos[PEBBLE_DECODER_MAX_BATCH];
        for (int32_t b = 0; b < n; b++) n_pos[b] = std::min(host_pos[b] + 1, L.kv_rows); // a ring's filled rows
        TRY(pebble_cpu::attend(n, q_rot, kv_type, k_of, v_of, n_pos, L.kv_rows, s.n_head, s.n_head_kv,
                               s.head_dim, L.attn_scale, s.attn_softcap, h16, scores));
    }
#else
    TRY(attention_in_groups(n, attention_of, stream));
#endif
    TRY(matvec_many(w.wo.ggml_type, w.wo.data, e, q, h16, n, o, stream));

    // feed-forward, its norm in one launch with the attention's residual where that has no norm of its own
    if (w.post_attn_norm.data) {
        TRY(residual(x, o, n, e, w.post_attn_norm, s, stream));
        TRY(norm_rows(x, n, e, w.ffn_norm, s.rms_eps, h16, stream));
    } else {
        LAUNCH(add_rms_rows_kernel, grid_for(n, 1), norm_threads, stream, x, o, n, e, s.residual_scale,
               w.ffn_norm.data, w.ffn_norm.ggml_type, s.rms_eps, h16);
        TRY(launched());
    }
    if (s.n_expert) {
        TRY(experts_ffn(d, i, n, h16, o, stream));
    } else {
        const matvec_part gate_up[2] = {{w.w_gate.ggml_type, w.w_gate.data, s.n_ff, gate},
                                        {w.w_up.ggml_type, w.w_up.data, s.n_ff, up}};
        TRY(matvec_parts(gate_up, 2, e, h16, n, stream));
        const int64_t ff = int64_t(n) * s.n_ff;
        TRY(gate_times_up(s.gelu, gate, up, ff, h16, stream));
        TRY(matvec_many(w.w_down.ggml_type, w.w_down.data, e, s.n_ff, h16, n, o, stream));
    }
    return residual(x, o, n, e, w.post_ffn_norm, s, stream);
}

// The fields of pebble_layer_weights in their order (pebble_step_layer.weight_ids).
pebble_tensor_ref pebble_layer_weights::* const weight_fields[PEBBLE_LAYER_WEIGHTS] = {
    &pebble_layer_weights::attn_norm, &pebble_layer_weights::wq, &pebble_layer_weights::wk,
    &pebble_layer_weights::wv, &pebble_layer_weights::wo, &pebble_layer_weights::ffn_norm,
    &pebble_layer_weights::w_gate, &pebble_layer_weights::w_up, &pebble_layer_weights::w_down,
    &pebble_layer_weights::bq, &pebble_layer_weights::bk, &pebble_layer_weights::bv,
    &pebble_layer_weights::q_norm, &pebble_layer_weights::k_norm, &pebble_layer_weights::post_attn_norm,
    &pebble_layer_weights::post_ffn_norm, &pebble_layer_weights::ffn_gate_inp, &pebble_layer_weights::ffn_gate_exps,
    &pebble_layer_weights::ffn_up_exps, &pebble_layer_weights::ffn_down_exps, &pebble_layer_weights::ffn_gate_inp_shexp,
    &pebble_layer_weights::ffn_gate_shexp, &pebble_layer_weights::ffn_up_shexp, &pebble_layer_weights::ffn_down_shexp};
const char * const weight_names[PEBBLE_LAYER_WEIGHTS] = {
    "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv", "q_norm",
    "k_norm", "post_attn_norm", "post_ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
    "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};

uint64_t kv_cache_bytes(const pebble_decoder & d, int32_t i) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    return uint64_t(L.kv_rows) * uint64_t(kv_bytes(d.model.kv_type, int64_t(L.shape.n_head_kv) * L.shape.head_dim));
}

#ifdef PEBBLE_HOST_BUILD
#    define COPY_STREAM(d) nullptr
#else
#    define COPY_STREAM(d) static_cast<void *>((d).copy)
#endif

// The n-th streamed layer's weights, and the rows each token of the step has written before its
// position, copied from the store into its slot (on the copy stream, after the slot's last layer
// computed); the slot's ready event recorded after them.
pebble_status restore_streamed(pebble_decoder & d, int32_t n, int32_t n_tok, const int32_t * seqs, const int64_t * pos) {
    const int32_t i = d.streamed[size_t(n)];
    [[maybe_unused]] const int32_t slot = n % 2;
    const pebble_step_layer & L = d.layers[size_t(i)];
    char where[96];
#ifndef PEBBLE_HOST_BUILD
    if (cudaStreamWaitEvent(d.copy, d.slot_free[slot], 0) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d: the copy stream could not wait for slot %d", i,
                    slot);
    }
#endif
    for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
        if (!streams_field(L, f)) continue;
        const pebble_tensor_ref & ref = L.weights.*weight_fields[f];
        pebble_status st = pebble_restore(d.model.store, i, L.weight_ids[f], const_cast<void *>(ref.data),
                                          d.weight_bytes[size_t(i)][size_t(f)], COPY_STREAM(d));
        if (st != PEBBLE_OK) {
            snprintf(where, sizeof where, "pebble_decoder_step: layer %d: %s", i, weight_names[f]);
            return with_place(st, where);
        }
    }
    const uint64_t row_bytes = kv_cache_bytes(d, i) / uint64_t(L.kv_rows);
    for (int32_t b = 0; b < n_tok; b++) {
        const uint64_t held = uint64_t(std::min(pos[b], L.kv_rows)); // a ring holds its window at most
        for (int kv = 0; kv < 2 && held; kv++) {
            void * cache = (kv ? d.v : d.k)[size_t(i) * d.model.n_seq + seqs[b]];
            pebble_status st = pebble_read(d.model.store, i, d.model.kv_ids[2 * seqs[b] + kv], 0, cache,
                                           held * row_bytes, COPY_STREAM(d));
            if (st != PEBBLE_OK) {
                snprintf(where, sizeof where, "pebble_decoder_step: layer %d: sequence %d's %s cache", i, seqs[b],
                         kv ? "V" : "K");
                return with_place(st, where);
            }
        }
    }
#ifndef PEBBLE_HOST_BUILD
    if (cudaEventRecord(d.slot_ready[slot], d.copy) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d: slot %d's ready event", i, slot);
    }
#endif
    return PEBBLE_OK;
}

// After the n-th streamed layer computed on `stream`: each token's new K and V row written back to the
// store (on the copy stream, after the compute), then the streamed layer two on restored into the slot.
pebble_status after_streamed(pebble_decoder & d, int32_t n, int32_t n_tok, const int32_t * seqs, const int64_t * pos,
                             [[maybe_unused]] cudaStream_t stream) {
    const int32_t i = d.streamed[size_t(n)];
    [[maybe_unused]] const int32_t slot = n % 2;
    const pebble_step_layer & L = d.layers[size_t(i)];
#ifndef PEBBLE_HOST_BUILD
    if (cudaEventRecord(d.slot_free[slot], stream) != cudaSuccess ||
        cudaStreamWaitEvent(d.copy, d.slot_free[slot], 0) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d: the copy stream could not wait for its compute", i);
    }
#endif
    const uint64_t row_bytes = kv_cache_bytes(d, i) / uint64_t(L.kv_rows);
    for (int32_t b = 0; b < n_tok; b++) {
        const uint64_t row = uint64_t(L.shape.ring ? pos[b] % L.kv_rows : pos[b]);
        for (int kv = 0; kv < 2; kv++) {
            const uint8_t * cache = static_cast<const uint8_t *>((kv ? d.v : d.k)[size_t(i) * d.model.n_seq + seqs[b]]);
            pebble_status st = pebble_write(d.model.store, i, d.model.kv_ids[2 * seqs[b] + kv], row * row_bytes,
                                            cache + row * row_bytes, row_bytes, COPY_STREAM(d));
            if (st != PEBBLE_OK) {
                char where[96];
                snprintf(where, sizeof where, "pebble_decoder_step: layer %d: writing back sequence %d's %s row", i,
                         seqs[b], kv ? "V" : "K");
                return with_place(st, where);
            }
        }
    }
    if (size_t(n) + 2 < d.streamed.size()) TRY(restore_streamed(d, n + 2, n_tok, seqs, pos));
    return PEBBLE_OK;
}

// The whole step enqueued on `stream`: every layer, then the output norm and logits where asked. The
// positions are in the scratch's pos (device memory) already; host_pos is the same, for the host build's
// attention.
pebble_status enqueue_step(pebble_decoder & d, int32_t n, const int32_t * seqs, const int64_t * host_pos, float * x,
                           float * logits, cudaStream_t stream) {
    const pebble_step_model & m = d.model;
    for (int32_t k = 0; k < 2 && size_t(k) < d.streamed.size(); k++) TRY(restore_streamed(d, k, n, seqs, host_pos));
    for (int32_t i = 0; i < m.n_layer; i++) {
        const int32_t order = d.stream_order[size_t(i)];
#ifndef PEBBLE_HOST_BUILD
        if (order >= 0 && cudaStreamWaitEvent(stream, d.slot_ready[order % 2], 0) != cudaSuccess) {
            cudaGetLastError();
            return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d could not wait for its slot", i);
        }
#endif
        if (m.expert_prefetch && d.layers[size_t(i)].experts_stored) TRY(prefetch_experts(d, i, n, x, stream));
        TRY(step_layer(d, i, n, seqs, host_pos, x, stream));
        if (order >= 0) TRY(after_streamed(d, order, n, seqs, host_pos, stream));
    }
#ifndef PEBBLE_HOST_BUILD
    // The step ends after its write-backs too, so that whoever waits for it may reuse the slots.
    if (!d.streamed.empty() && (cudaEventRecord(d.copied, d.copy) != cudaSuccess ||
                                cudaStreamWaitEvent(stream, d.copied, 0) != cudaSuccess)) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: the step could not wait for its write-backs");
    }
#endif
    if (logits) {
        act_t * h16 = at_offset<act_t>(d.scratch, d.at.h16);
        TRY(norm_rows(x, n, m.n_embd, m.output_norm, m.rms_eps, h16, stream));
        TRY(matvec_many(m.output.ggml_type, m.output.data, m.n_vocab, m.n_embd, h16, n, logits, stream));
        if (m.logit_scale != 1.0f || m.final_softcap > 0.0f) {
            const int64_t total = int64_t(n) * m.n_vocab;
            LAUNCH(logits_kernel, grid_for(total, threads), threads, stream, logits, total, m.logit_scale, m.final_softcap);
            TRY(launched());
        }
    }
    return PEBBLE_OK;
}

#ifndef PEBBLE_HOST_BUILD
pebble_status cuda_failed(cudaError_t err, const char * what) {
    cudaGetLastError();
    return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: %s: %s", what, cudaGetErrorString(err));
}

#    define CUDA_TRY(call, what)                              \
        do {                                                  \
            const cudaError_t err_ = (call);                  \
            if (err_ != cudaSuccess) return cuda_failed(err_, what); \
        } while (0)

// The positions' copy and the step, enqueued on the decoder's stream; captured into the graph of `slot`
// first where mode is capture (a capture that fails turns graphs off for this decoder: the step then runs
// directly).
pebble_status enqueue_or_capture(pebble_decoder & d, step_mode mode, int slot, const step_key & key,
                                 const int64_t * pos) {
    const int32_t n = key.n;
    float * x = at_offset<float>(d.scratch, d.at.x);
    float * logits = key.logits ? at_offset<float>(d.scratch, d.at.logits) : nullptr;
    auto body = [&]() -> pebble_status {
        CUDA_TRY(cudaMemcpyAsync(at_offset<int64_t>(d.scratch, d.at.pos), d.pos_host, sizeof(int64_t) * size_t(n),
                                 cudaMemcpyDefault, d.own), "copying the positions");
        return enqueue_step(d, n, key.seqs, pos, x, logits, d.own);
    };
    if (mode == step_mode::replay) {
        CUDA_TRY(cudaGraphLaunch(d.graphs.slots[slot].exec, d.own), "replaying the step's graph");
        return PEBBLE_OK;
    }
    if (mode == step_mode::capture) {
        cudaGraph_t graph = nullptr;
        if (cudaStreamBeginCapture(d.own, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
            const pebble_status st = body();
            const cudaError_t ended = cudaStreamEndCapture(d.own, &graph);
            if (st != PEBBLE_OK) {
                if (graph) cudaGraphDestroy(graph);
                return st;
            }
            cudaGraphExec_t exec = nullptr;
            if (ended == cudaSuccess && graph && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
                cudaGraphDestroy(graph);
                d.graphs.slots[slot].exec = exec;
                d.graphs.keep(slot, key);
                CUDA_TRY(cudaGraphLaunch(exec, d.own), "launching the step's graph");
                return PEBBLE_OK;
            }
            if (graph) cudaGraphDestroy(graph);
        }
        cudaGetLastError();
        d.graphs.give_up();
    }
    return body();
}

// A step on the GPU: ordered after the caller's stream, x in and out of the decoder's own buffer (a graph
// names fixed addresses), the caller's stream ordered after it.
pebble_status run_on_device(pebble_decoder & d, step_mode mode, int slot, const step_key & key, const int64_t * pos,
                            float * x, float * logits, cudaStream_t caller) {
    const int32_t n = key.n;
    const size_t x_bytes = sizeof(float) * size_t(n) * size_t(d.model.n_embd);
    CUDA_TRY(cudaEventSynchronize(d.done), "waiting for the previous step"); // its graph may still read pos_host
    std::memcpy(d.pos_host, pos, sizeof(int64_t) * size_t(n));
    CUDA_TRY(cudaEventRecord(d.ready, caller), "ordering the step after its stream");
    CUDA_TRY(cudaStreamWaitEvent(d.own, d.ready, 0), "ordering the step after its stream");
    CUDA_TRY(cudaMemcpyAsync(at_offset<float>(d.scratch, d.at.x), x, x_bytes, cudaMemcpyDefault, d.own),
             "copying x in");
    const pebble_status st = enqueue_or_capture(d, mode, slot, key, pos);
    if (st == PEBBLE_OK) {
        CUDA_TRY(cudaMemcpyAsync(x, at_offset<float>(d.scratch, d.at.x), x_bytes, cudaMemcpyDefault, d.own),
                 "copying x out");
        if (logits) {
            CUDA_TRY(cudaMemcpyAsync(logits, at_offset<float>(d.scratch, d.at.logits),
                                     sizeof(float) * size_t(n) * size_t(d.model.n_vocab), cudaMemcpyDefault,
                                     d.own), "copying the logits out");
        }
    }
    CUDA_TRY(cudaEventRecord(d.done, d.own), "ordering the stream after the step");
    CUDA_TRY(cudaStreamWaitEvent(caller, d.done, 0), "ordering the stream after the step");
    return st;
}
#    undef CUDA_TRY
#endif

// A streamed layer as the store holds it: each weight's entry size, checked against its type and shape,
// and a stand-in pointer for the checks until its slot is placed (place_streamed).
pebble_status describe_streamed(pebble_decoder & d, const char * fn, int32_t i) {
    pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_step_model & m = d.model;
    if (!m.store || !m.kv_ids) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d is streamed: the model's store and kv_ids must not be "
                    "NULL", fn, i);
    }
    const pebble_layer_shape & s = L.shape;
    const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
    const int64_t E = s.n_expert, fx = s.n_ff_exp, sh = s.n_ff_shexp;
    const int64_t rows[PEBBLE_LAYER_WEIGHTS] = {1, q, kv, kv, e, 1, s.n_ff, s.n_ff, e, 1, 1, 1, 1, 1, 1, 1,
                                                E, E * fx, E * fx, E * e, 1, sh, sh, e};
    const int64_t cols[PEBBLE_LAYER_WEIGHTS] = {e, e, e, e, q, e, e, e, s.n_ff, q, kv, kv, s.head_dim, s.head_dim, e, e,
                                                e, e, e, fx, e, e, e, sh};
    for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
        pebble_tensor_ref & ref = L.weights.*weight_fields[f];
        ref.data = nullptr;
        if (!streams_field(L, f)) continue;
        struct pebble_entry_info info{};
        const pebble_status st = pebble_entry_info(m.store, i, L.weight_ids[f], &info);
        if (st != PEBBLE_OK) {
            char where[96];
            snprintf(where, sizeof where, "%s: layer %d: %s", fn, i, weight_names[f]);
            return with_place(st, where);
        }
        int64_t elements = 0, block = 0;
        if (pebble_type_block(ref.ggml_type, &elements, &block) != PEBBLE_OK || cols[f] % elements != 0 ||
            info.nbytes != uint64_t(rows[f]) * uint64_t(cols[f] / elements) * uint64_t(block)) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d: %s's entry (tensor %d) holds %" PRIu64 " bytes, not "
                        "%" PRId64 " x %" PRId64 " of GGUF type %d (%s)", fn, i, weight_names[f], L.weight_ids[f],
                        info.nbytes, rows[f], cols[f], ref.ggml_type, ggml_type_name(ref.ggml_type));
        }
        d.weight_bytes[size_t(i)][size_t(f)] = info.nbytes;
        ref.data = &d; // a stand-in until the slot is placed: never read
    }
    for (int32_t seq = 0; seq < m.n_seq; seq++) {
        for (int kv_i = 0; kv_i < 2; kv_i++) {
            struct pebble_entry_info info{};
            const int32_t id = m.kv_ids[2 * seq + kv_i];
            if (pebble_entry_info(m.store, i, id, &info) != PEBBLE_OK || info.nbytes != kv_cache_bytes(d, i)) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d: sequence %d's %s cache (tensor %d) is not an "
                            "entry of %" PRIu64 " bytes", fn, i, seq, kv_i ? "V" : "K", id, kv_cache_bytes(d, i));
            }
        }
    }
    d.stream_order[size_t(i)] = static_cast<int32_t>(d.streamed.size());
    d.streamed.push_back(i);
    return PEBBLE_OK;
}

// Each streamed layer's weights and caches at their places in its slot (weights first, then each
// sequence's K and V), and the slots (as large as the largest layer) made.
pebble_status place_streamed(pebble_decoder & d, const char * fn) {
    const int32_t n_seq = d.model.n_seq;
    std::vector<std::vector<uint64_t>> offsets(d.streamed.size());
    for (size_t n = 0; n < d.streamed.size(); n++) {
        const int32_t i = d.streamed[n];
        uint64_t at = 0;
        for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
            offsets[n].push_back(at);
            at += aligned(d.weight_bytes[size_t(i)][size_t(f)]);
        }
        for (int32_t seq = 0; seq < 2 * n_seq; seq++) {
            offsets[n].push_back(at);
            at += aligned(kv_cache_bytes(d, i));
        }
        d.slot_bytes = std::max(d.slot_bytes, at);
    }
    const size_t n_slots = std::min<size_t>(2, d.streamed.size());
    if (d.model.slots[0]) { // the caller's
        for (size_t k = 0; k < n_slots; k++) {
            if (!d.model.slots[k] || d.model.slot_bytes < d.slot_bytes) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %zu slots of at least %" PRIu64 " bytes are needed for the "
                            "streamed layers; slot %zu is %s of %" PRIu64, fn, n_slots, d.slot_bytes, k,
                            d.model.slots[k] ? "one" : "NULL, the other", d.model.slot_bytes);
            }
#ifndef PEBBLE_HOST_BUILD
            TRY(check_device_pointer(d.model.slots[k], "a slot", fn));
#endif
            d.slots_given[k] = static_cast<uint8_t *>(d.model.slots[k]);
        }
    } else {
        for (size_t k = 0; k < n_slots; k++) TRY(alloc_scratch(&d.slots[k], d.slot_bytes));
    }
    for (size_t n = 0; n < d.streamed.size(); n++) {
        const int32_t i = d.streamed[n];
        uint8_t * base = d.slots_given[0] ? d.slots_given[n % 2] : d.slots[n % 2];
        pebble_step_layer & L = d.layers[size_t(i)];
        for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
            pebble_tensor_ref & ref = L.weights.*weight_fields[f];
            if (ref.data) ref.data = base + offsets[n][size_t(f)];
        }
        for (int32_t seq = 0; seq < n_seq; seq++) {
            d.k[size_t(i) * n_seq + seq] = base + offsets[n][PEBBLE_LAYER_WEIGHTS + 2 * seq];
            d.v[size_t(i) * n_seq + seq] = base + offsets[n][PEBBLE_LAYER_WEIGHTS + 2 * seq + 1];
        }
    }
#ifndef PEBBLE_HOST_BUILD
    if (cudaStreamCreateWithFlags(&d.copy, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_ready[0], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_ready[1], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_free[0], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_free[1], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.copied, cudaEventDisableTiming) != cudaSuccess) {
        const cudaError_t err = cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "%s: the slots' copy stream or events could not be made: %s", fn,
                    cudaGetErrorString(err));
    }
#else
    (void)fn;
#endif
    return PEBBLE_OK;
}

// Each layer whose experts are pebbles: its entries checked (one per expert, of the expert's gate, up and
// down rows); then the slots for experts made (pebble_step_model.expert_policy): each such layer's cache
// and the staging slots.
pebble_status place_experts(pebble_decoder & d, const char * fn) {
    d.experts.resize(d.layers.size());
    const pebble_step_model & m = d.model;
    if ((m.expert_policy != 0 && m.expert_policy != 1) || (m.expert_prefetch != 0 && m.expert_prefetch != 1)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: expert_policy %d must be 0 (least recently used) or 1 (least "
                    "often used), expert_prefetch %d 0 or 1", fn, m.expert_policy, m.expert_prefetch);
    }
    uint64_t slot_bytes = 0, cached = 0;
    int32_t most_used = 0;
    bool uncached = false;
    for (size_t i = 0; i < d.layers.size(); i++) {
        const pebble_step_layer & L = d.layers[i];
        if (L.experts_stored == 0) continue;
        const pebble_layer_shape & s = L.shape;
        const bool merged = L.experts_stored == 2;
        if ((L.experts_stored != 1 && !merged) || s.n_expert < 1 || !(merged ? m.store : expert_store(d)) ||
            (!merged && (L.expert_ids < 0 || L.expert_ids > INT32_MAX - s.n_expert)) || L.expert_cache < 0 ||
            L.expert_cache > s.n_expert) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %zu: experts_stored %d needs 0, or 1 or 2 with experts "
                        "(n_expert %d), the model's store, (for 1) expert_ids %d at least 0 and expert_cache %d "
                        "within 0..n_expert", fn, i, L.experts_stored, s.n_expert, L.expert_ids, L.expert_cache);
        }
        pebble_decoder::expert_cache & c = d.experts[i];
        c.part_bytes[0] = row_bytes(L.weights.ffn_gate_exps.ggml_type, s.n_embd) * uint64_t(s.n_ff_exp);
        c.part_bytes[1] = row_bytes(L.weights.ffn_up_exps.ggml_type, s.n_embd) * uint64_t(s.n_ff_exp);
        c.part_bytes[2] = row_bytes(L.weights.ffn_down_exps.ggml_type, s.n_ff_exp) * uint64_t(s.n_embd);
        c.nbytes = c.part_bytes[0] + c.part_bytes[1] + c.part_bytes[2];
        for (int f = 0; f < 3 && merged; f++) {
            struct pebble_entry_info info{};
            const int32_t id = L.weight_ids[merged_expert_fields[f]];
            if (pebble_entry_info(m.store, static_cast<int32_t>(i), id, &info) != PEBBLE_OK ||
                info.nbytes != c.part_bytes[f] * uint64_t(s.n_expert)) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %zu: %s (tensor %d) is not an entry of %" PRIu64
                            " bytes (%d experts of %" PRIu64 ")", fn, i, weight_names[merged_expert_fields[f]], id,
                            c.part_bytes[f] * uint64_t(s.n_expert), s.n_expert, c.part_bytes[f]);
            }
        }
        for (int32_t j = 0; j < s.n_expert && !merged; j++) {
            struct pebble_entry_info info{};
            if (pebble_entry_info(expert_store(d), static_cast<int32_t>(i), L.expert_ids + j, &info) != PEBBLE_OK ||
                info.nbytes != c.nbytes) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %zu: expert %d (tensor %d) is not an entry of %" PRIu64
                            " bytes (its gate, up and down rows)", fn, i, j, L.expert_ids + j, c.nbytes);
            }
        }
        c.expert.assign(size_t(L.expert_cache), -1);
        c.used.assign(size_t(L.expert_cache), 0);
        c.uses.assign(size_t(s.n_expert), 0);
        slot_bytes = std::max(slot_bytes, aligned(c.nbytes));
        cached += uint64_t(L.expert_cache);
        most_used = std::max(most_used, s.n_expert_used);
        uncached = uncached || L.expert_cache == 0;
    }
    if (slot_bytes == 0) return PEBBLE_OK;
    d.staging.resize(m.expert_prefetch ? size_t(most_used) : uncached ? 1 : 0);
    const uint64_t slots = cached + d.staging.size();
    TRY(alloc_scratch(&d.expert_buffer, slot_bytes * slots));
    d.stats.expert_device_bytes = slot_bytes * slots;
    uint8_t * at = d.expert_buffer;
    for (pebble_decoder::expert_cache & c : d.experts) {
        for (size_t k = 0; k < c.expert.size(); k++, at += slot_bytes) c.slot.push_back(at);
    }
    for (pebble_decoder::staged & g : d.staging) {
        g.slot = at;
        at += slot_bytes;
    }
    d.to_run.assign(size_t(d.max_expert), 0);
    d.guess_score.assign(size_t(d.max_expert), 0.0f);
    d.guessed.reserve(size_t(most_used));
    return PEBBLE_OK;
}

// Handles are ids, never reused, so that a freed decoder is detected rather than dereferenced.
std::mutex                                                    g_decoders_mu;
std::unordered_map<uintptr_t, std::shared_ptr<pebble_decoder>> g_decoders;
uintptr_t                                                     g_next_decoder = 1;

std::shared_ptr<pebble_decoder> find_decoder(pebble_decoder_t handle) {
    std::lock_guard<std::mutex> hold(g_decoders_mu);
    auto it = g_decoders.find(reinterpret_cast<uintptr_t>(handle));
    return it == g_decoders.end() ? nullptr : it->second;
}

pebble_status closed(const char * fn) { return fail(PEBBLE_ERR_CLOSED, "%s: the decoder was freed or never made", fn); }

// What a decoder holds beside its description: scratch, graphs and, on the GPU, its stream, events and
// pinned positions (its last step finished first).
void release_device(pebble_decoder & d) {
#ifndef PEBBLE_HOST_BUILD
    if (d.done) cudaEventSynchronize(d.done);
    if (d.copy) cudaStreamSynchronize(d.copy);
#endif
    d.graphs.give_up();
#ifndef PEBBLE_HOST_BUILD
    if (d.ready) cudaEventDestroy(d.ready);
    if (d.done) cudaEventDestroy(d.done);
    if (d.own) cudaStreamDestroy(d.own);
    if (d.pos_host) cudaFreeHost(d.pos_host);
    d.ready = d.done = nullptr;
    d.own = nullptr;
    d.pos_host = nullptr;
#endif
    free_scratch(d.scratch);
    d.scratch = nullptr;
    free_scratch(d.expert_buffer);
    d.expert_buffer = nullptr;
    for (uint8_t *& slot : d.slots) {
        free_scratch(slot);
        slot = nullptr;
    }
#ifndef PEBBLE_HOST_BUILD
    for (int k = 0; k < 2; k++) {
        if (d.slot_ready[k]) cudaEventDestroy(d.slot_ready[k]);
        if (d.slot_free[k]) cudaEventDestroy(d.slot_free[k]);
        d.slot_ready[k] = d.slot_free[k] = nullptr;
    }
    if (d.copied) cudaEventDestroy(d.copied);
    if (d.copy) cudaStreamDestroy(d.copy);
    d.copied = nullptr;
    d.copy = nullptr;
#endif
}

} // namespace

extern "C" pebble_status pebble_decoder_create(const pebble_step_model * model, const pebble_step_layer * layers,
                                               void * const * k_caches, void * const * v_caches, pebble_decoder_t * out) {
    const char * fn = "pebble_decoder_create";
    if (!model || !layers || !k_caches || !v_caches || !out) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: model, layers, k_caches, v_caches and out must not be NULL", fn);
    }
    *out = nullptr;
    const pebble_step_model & m = *model;
    if (m.n_layer < 1 || m.n_embd < 1 || m.n_vocab < 1 || m.n_seq < 1 || m.n_seq > PEBBLE_DECODER_MAX_BATCH) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: n_layer %d, n_embd %d and n_vocab %d must each be at least 1, "
                    "n_seq %d within 1..%d", fn, m.n_layer, m.n_embd, m.n_vocab, m.n_seq, PEBBLE_DECODER_MAX_BATCH);
    }
    if (!kv_known(m.kv_type)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: kv_type %d (%s); the caches must be 0 F32, 1 F16, 8 Q8_0 or 2 Q4_0",
                    fn, m.kv_type, ggml_type_name(m.kv_type));
    }
    if (!std::isfinite(m.logit_scale) || !(m.final_softcap >= 0.0f) || !std::isfinite(m.final_softcap)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: logit_scale %g must be finite, final_softcap %g finite and at "
                    "least 0", fn, static_cast<double>(m.logit_scale), static_cast<double>(m.final_softcap));
    }
    pebble_status st = check_vector("output_norm", m.output_norm, false);
    if (st == PEBBLE_OK) st = check_weight("output", m.output, m.n_vocab, m.n_embd);
    if (st != PEBBLE_OK) return with_place(st, fn);
    auto d = std::make_shared<pebble_decoder>();
    d->model = m;
    d->layers.assign(layers, layers + m.n_layer);
    const size_t n_caches = size_t(m.n_layer) * size_t(m.n_seq);
    d->k.assign(k_caches, k_caches + n_caches);
    d->v.assign(v_caches, v_caches + n_caches);
    d->stream_order.assign(size_t(m.n_layer), -1);
    d->weight_bytes.assign(size_t(m.n_layer), {});
    for (int32_t i = 0; i < m.n_layer; i++) {
        if (layers[i].streamed) TRY(describe_streamed(*d, fn, i));
    }
    for (int32_t i = 0; i < m.n_layer; i++) {
        const pebble_step_layer & L = d->layers[size_t(i)];
        TRY(check_layer(fn, i, L.shape, L.weights, L.kv_rows, L.experts_stored != 0));
        if (L.shape.n_embd != m.n_embd) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d is %d wide; the model is %d", fn, i, L.shape.n_embd,
                        m.n_embd);
        }
        if (!L.rope_cos || !L.rope_sin || L.rope_rows < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: rope_cos and rope_sin must not be NULL, rope_rows "
                        "(%" PRId64 ") at least 1", fn, i, L.rope_rows);
        }
        const int64_t kv_row = int64_t(L.shape.n_head_kv) * L.shape.head_dim;  // a cache row's elements
        if (L.kv_rows > INT64_MAX / 4 / m.n_seq / std::max<int64_t>(L.shape.n_head, kv_row) ||
            L.rope_rows > INT64_MAX / 4 / L.shape.head_dim) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d: kv_rows %" PRId64 " or rope_rows %" PRId64 " is too "
                        "large to address", fn, i, L.kv_rows, L.rope_rows);
        }
        if (kv_blocked(m.kv_type) && L.shape.head_dim % kv_block != 0) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: head_dim %d is not a multiple of %d, which %s "
                        "caches need", fn, i, L.shape.head_dim, kv_block, ggml_type_name(m.kv_type));
        }
        if (!std::isfinite(L.attn_scale)) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: attn_scale %g must be finite", fn, i,
                        static_cast<double>(L.attn_scale));
        }
        for (int32_t s = 0; s < m.n_seq && !L.streamed; s++) {
            if (!d->k[size_t(i) * m.n_seq + s] || !d->v[size_t(i) * m.n_seq + s]) {
                return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: sequence %d has a NULL cache", fn, i, s);
            }
        }
        const int64_t q = int64_t(L.shape.n_head) * L.shape.head_dim, kv = int64_t(L.shape.n_head_kv) * L.shape.head_dim;
        d->widest = std::max<int64_t>({d->widest, L.shape.n_embd, q, L.shape.n_ff});
        d->max_q = std::max(d->max_q, q);
        d->max_kv = std::max(d->max_kv, kv);
        d->max_ff = std::max<int64_t>({d->max_ff, L.shape.n_ff, L.shape.n_expert ? L.shape.n_ff_exp : 0,
                                       L.shape.n_expert ? L.shape.n_ff_shexp : 0});
        d->max_expert = std::max<int64_t>(d->max_expert, L.shape.n_expert);
        d->max_heads = std::max<int64_t>(d->max_heads, L.shape.n_head);
        d->max_rows = std::max(d->max_rows, L.kv_rows);
    }
#ifndef PEBBLE_HOST_BUILD
    for (size_t c = 0; c < n_caches; c++) {
        if (d->layers[c / size_t(m.n_seq)].streamed) continue; // a slot's, placed below
        TRY(check_device_pointer(d->k[c], "a K cache", fn));
        TRY(check_device_pointer(d->v[c], "a V cache", fn));
    }
#endif
    const uint64_t B = uint64_t(m.n_seq);
    uint64_t at = 0;
    auto take = [&at](uint64_t bytes) { const uint64_t here = at; at += aligned(bytes); return here; };
    step_scratch & l = d->at;
    l.h16 = take(sizeof(act_t) * B * uint64_t(std::max<int64_t>(d->widest, m.n_embd)));
    l.q = take(4 * B * uint64_t(d->max_q));
    l.k = take(4 * B * uint64_t(d->max_kv));
    l.v = take(4 * B * uint64_t(d->max_kv));
    l.q_rot = take(4 * B * uint64_t(d->max_q));
    l.kv_new = take(4 * 2 * B * uint64_t(d->max_kv));  // the new K and V rows before they are stored
    l.scores = take(4 * B * uint64_t(d->max_heads) * uint64_t(d->max_rows));
    // each layer's n_head x parts x head_dim sums and n_head x parts x 2 (largest score, sum of exps) fit
    d->parts_per_seq = (d->max_q + 2 * d->max_heads) * split_parts(d->max_rows);
    l.parts = take(4 * B * uint64_t(d->parts_per_seq));
    l.o = take(4 * B * uint64_t(m.n_embd));
    l.gate = take(4 * B * uint64_t(d->max_ff));
    l.up = take(4 * B * uint64_t(d->max_ff));
    l.pos = take(8 * B);
    if (d->max_expert) {
        l.router = take(4 * B * uint64_t(d->max_expert));
        l.rows = take(sizeof(act_t) * B * uint64_t(m.n_embd));
        l.act = take(sizeof(act_t) * B * uint64_t(d->max_ff));
        l.y = take(4 * B * uint64_t(m.n_embd));
        d->router_host.assign(size_t(B) * size_t(d->max_expert), 0.0f);
        d->router_p.assign(size_t(d->max_expert), 0.0f);
        d->router_order.assign(size_t(d->max_expert), 0);
    }
#ifndef PEBBLE_HOST_BUILD
    l.x = take(4 * B * uint64_t(m.n_embd));       // x and the logits in and out of fixed addresses (a graph's)
    l.logits = take(4 * B * uint64_t(m.n_vocab));
#endif
    l.bytes = at;
    // The store's copies are not captured, nor is a step whose launches follow its router's choice.
    d->graphs.enabled = m.graphs != 0 && d->streamed.empty() && d->max_expert == 0;
    TRY(alloc_scratch(&d->scratch, l.bytes));
    d->stats.scratch_bytes = l.bytes;
    pebble_status placed = place_experts(*d, fn);
    if (placed != PEBBLE_OK) {
        release_device(*d);
        return placed;
    }
    if (!d->streamed.empty()) {
        pebble_status st = place_streamed(*d, fn);
        if (st != PEBBLE_OK) {
            release_device(*d);
            return st;
        }
    }
#ifndef PEBBLE_HOST_BUILD
    if (cudaHostAlloc(reinterpret_cast<void **>(&d->pos_host), 8 * B, cudaHostAllocPortable) != cudaSuccess ||
        cudaStreamCreateWithFlags(&d->own, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&d->ready, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d->done, cudaEventDisableTiming) != cudaSuccess) {
        const cudaError_t err = cudaGetLastError();
        release_device(*d);
        return fail(PEBBLE_ERR_CUDA, "%s: the decoder's stream, events or pinned positions could not be made: %s", fn,
                    cudaGetErrorString(err));
    }
#endif
    std::lock_guard<std::mutex> hold(g_decoders_mu);
    const uintptr_t id = g_next_decoder++;
    g_decoders.emplace(id, std::move(d));
    *out = reinterpret_cast<pebble_decoder_t>(id);
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_decoder_step(pebble_decoder_t handle, int32_t n, const int32_t * seqs, const int64_t * pos,
                                             float * x, float * logits, void * stream_ptr) {
    const char * fn = "pebble_decoder_step";
    const std::shared_ptr<pebble_decoder> d = find_decoder(handle);
    if (!d) return closed(fn);
    std::lock_guard<std::mutex> hold(d->lock);
    const pebble_step_model & m = d->model;
    if (n < 1 || n > m.n_seq) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %d tokens; the decoder holds 1..%d sequences", fn, n, m.n_seq);
    }
    if (!seqs || !pos || !x) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: seqs, pos and x must not be NULL", fn);
    uint64_t seen = 0;
    for (int32_t b = 0; b < n; b++) {
        if (seqs[b] < 0 || seqs[b] >= m.n_seq || (seen >> seqs[b] & 1)) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: token %d is of sequence %d; each of 0..%d at most once a step",
                        fn, b, seqs[b], m.n_seq - 1);
        }
        seen |= uint64_t(1) << seqs[b];
        for (int32_t i = 0; i < m.n_layer; i++) {
            const pebble_step_layer & L = d->layers[size_t(i)];
            if (pos[b] < 0 || pos[b] >= L.rope_rows || (pos[b] >= L.kv_rows && !L.shape.ring)) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: sequence %d at position %" PRId64 " is outside layer %d's "
                            "0..%" PRId64, fn, seqs[b], pos[b], i, std::min(L.rope_rows, L.shape.ring ? INT64_MAX : L.kv_rows) - 1);
            }
        }
    }
#ifndef PEBBLE_HOST_BUILD
    TRY(check_device_pointer(x, "x", fn));
    if (logits) TRY(check_device_pointer(logits, "logits", fn));
#endif
    step_key key;
    key.n = n;
    key.logits = logits != nullptr;
    std::copy(seqs, seqs + n, key.seqs);
    int slot = 0;
    const step_mode mode = d->graphs.decide(key, &slot);
#ifdef PEBBLE_HOST_BUILD
    (void)stream_ptr;
    std::memcpy(at_offset<int64_t>(d->scratch, d->at.pos), pos, sizeof(int64_t) * size_t(n));
    TRY(enqueue_step(*d, n, seqs, pos, x, logits, nullptr));
    if (mode == step_mode::capture) d->graphs.keep(slot, key);
#else
    TRY(run_on_device(*d, mode, slot, key, pos, x, logits, static_cast<cudaStream_t>(stream_ptr)));
#endif
    d->stats.steps++;
    d->stats.tokens += uint64_t(n);
    d->stats.layer_passes += uint64_t(m.n_layer);
    d->stats.graphs_captured = d->graphs.captured;
    d->stats.graph_replays = d->graphs.replays;
    d->stats.graphs_dropped = d->graphs.dropped;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_decoder_stats(pebble_decoder_t handle, struct pebble_decoder_stats * out) {
    const std::shared_ptr<pebble_decoder> d = find_decoder(handle);
    if (!d) return closed("pebble_decoder_stats");
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decoder_stats: out must not be NULL");
    std::lock_guard<std::mutex> hold(d->lock);
    *out = d->stats;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_decoder_free(pebble_decoder_t handle) {
    if (!handle) return PEBBLE_OK;
    std::shared_ptr<pebble_decoder> d;
    {
        std::lock_guard<std::mutex> hold(g_decoders_mu);
        auto it = g_decoders.find(reinterpret_cast<uintptr_t>(handle));
        if (it == g_decoders.end()) return closed("pebble_decoder_free");
        d = std::move(it->second);
        g_decoders.erase(it);
    }
    std::lock_guard<std::mutex> hold(d->lock); // a step in flight on another thread ends first
    release_device(*d);
    return PEBBLE_OK;
}

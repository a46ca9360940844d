// cuda/ops.cuh: the operations the decode step and pebble_attend are made of, each the launcher of one
// source under cuda/ beside its kernels, with the arguments it takes: matrix products (matvec.cu), RMS
// norms and residual adds (norm.cu), biases, RoPE and the new K/V rows (rope.cu), attention
// (attention.cu), the gated activations and the logits' scale and cap (activations.cu). On the GPU a
// launcher enqueues its kernels on `stream`; in the host build it has computed when it returns. Not part
// of the ABI.
#pragma once

#include "cuda/common.cuh"

#include <cstdint>

namespace pebble_internal {

// ---------------------------------------------------------------------------------------------------
// matrix products (matvec.cu)

// y = W x for one fp16 vector, arguments already checked, enqueued on `stream`;
pebble_status matvec_one(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const uint16_t * x,
                         float * y, cudaStream_t stream);
// Y = W X for n_vec vectors one after another (y likewise), arguments already checked, on `stream`: the decode
// step's activations, float32 in the host build (rounded to fp16 for quantized weights, as they are for dense
// ones: cpu/cpu.h: matmul's exact_f32) and fp16 in the CUDA build;
pebble_status matvec_many(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const void * x,
                          int64_t n_vec, float * y, cudaStream_t stream);
// matvec_many for up to 4 matrices of n_cols columns times the same vectors: on the host one pass of the
// CPU's threads for them all (cpu/cpu.h: matmul_parts), on the GPU one launch each;
struct matvec_part {
    int32_t      ggml_type;
    const void * w;
    int64_t      n_rows;
    float *      y;
};
pebble_status matvec_parts(const matvec_part * parts, int n_parts, int64_t n_cols, const void * x, int64_t n_vec,
                           cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------
// norms and residuals (norm.cu)

// out[r] = x[r] / rms(x[r]) * w for each of n rows of e values: one launch.
pebble_status norm_rows(const float * x, int64_t n, int64_t e, const pebble_tensor_ref & w, float eps, act_t * out,
                        cudaStream_t stream);
// out[r] = x[r] / rms(x[r]) * (w / divisor) for n rows of e values (Gemma 4's router input, w its ffn_gate_inp_s
// and divisor sqrt(n_embd)): one launch.
pebble_status scaled_norm_rows(const float * x, int64_t n, int64_t e, const pebble_tensor_ref & w, float divisor,
                               float eps, act_t * out, cudaStream_t stream);
// a[r] = b[r] / rms(b[r]) * wb + a[r] / rms(a[r]) * wa for n rows of e values (Gemma 4's dense FFN b and experts
// a, each normed after, added): one launch.
pebble_status two_norms_add(float * a, const float * b, int64_t n, int64_t e, const pebble_tensor_ref & wa,
                            const pebble_tensor_ref & wb, float eps, cudaStream_t stream);
// x[r] += o[r] * add_scale (a residual), then out[r] = x[r] / rms(x[r]) * w, for n rows of e values: one launch.
pebble_status add_norm_rows(float * x, const float * o, int64_t n, int64_t e, float add_scale,
                            const pebble_tensor_ref & w, float eps, act_t * out, cudaStream_t stream);
// x += o (normed by `norm` where given) * residual_scale, for n_rows rows of e values.
pebble_status residual(float * x, const float * o, int64_t n_rows, int64_t e, const pebble_tensor_ref & norm,
                       const pebble_layer_shape & s, cudaStream_t stream);
// y [n_heads][head_dim], in place: each head y / sqrt(mean(y^2) + eps) * w (Q/K norms).
pebble_status head_norm(float * y, int32_t n_heads, int32_t head_dim, const pebble_tensor_ref & w, float eps,
                        cudaStream_t stream);
// dst [n_heads][head_dim] = each head of src / sqrt(mean(src^2) + eps), no weight (Gemma 4's V; src may be dst).
pebble_status v_norm(const float * src, float * dst, int32_t n_heads, int32_t head_dim, float eps, cudaStream_t stream);
// x *= w[0] for n elements (w a one-element F32 or F16 vector: Gemma 4's layer output scale).
pebble_status scale_by(float * x, int64_t n, const pebble_tensor_ref & w, cudaStream_t stream);
// x += y * scale for n elements.
pebble_status add_scaled(float * x, const float * y, int64_t n, float scale, cudaStream_t stream);
// y[r][i] += b[offset + i] for n_rows rows of `width` (a bias; b F32 or F16; gpt-oss's output, router and
// experts' biases, an expert's at its offset in the layer's stack).
pebble_status add_bias(float * y, int64_t n_rows, int64_t width, const pebble_tensor_ref & b, int64_t offset,
                       cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------
// biases, RoPE and the new K/V rows (rope.cu)

// A sequence's q, k and v after their projections, and where they go.
struct qkv_args {
    const float * q, * k, * v;            // the projections
    pebble_tensor_ref bq, bk, bv;         // biases, data NULL when absent
    int32_t n_q, n_kv, head_dim, rope_dims, rope_neox;
    const float * cos, * sin;             // the RoPE tables, a row of head_dim per position
    const int64_t * pos;                  // the token's position, read where the kernel runs (so a graph replays)
    float * q_out, * k_out, * v_out;      // q and k with biases, rotated; v with its bias (float32)
};

// A sequence's new K and V rows (float32), and the caches' row they go to: row pos, or pos % kv_rows in a ring.
struct kv_row_args {
    const float * k, * v;                 // the new rows, float32
    void *        k_cache, * v_cache;
    int32_t       type;
    int64_t       n_kv;
    const int64_t * pos;
    int64_t       kv_rows;
    int32_t       ring;
};

// The n sequences of a step (qkv[b], kv_rows[b] each one's): biases and RoPE, then the new rows stored.
pebble_status rope_and_store(int32_t n, const qkv_args * qkv, const kv_row_args * kv_rows, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------
// attention (attention.cu)

struct attention_args {
    const float * q;                      // rotated, unscaled
    const void * k_cache, * v_cache;
    int32_t kv_type, n_head, n_head_kv, head_dim;
    int64_t n_pos, n_ctx;                 // rows attended; rows of the scores buffer
    float scale, softcap;                 // softcap above 0: s -> c * tanh(s / c)
    const float * sinks;                  // where not NULL, n_head logits each in its head's softmax (gpt-oss)
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

// The attention of a group of sequences (attention_args each): its kernels on the stream, each one launch
// for the group, or run here in turn.
pebble_status attention(const arg_group<attention_args> & g, cudaStream_t stream);

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

// ---------------------------------------------------------------------------------------------------
// activations (activations.cu)

// out = act(gate) * up for n elements: `activation` as pebble_layer_shape's (0 SiLU, 1 GELU's tanh
// approximation, 2 gpt-oss's clamped SwiGLU).
pebble_status gate_times_up(int32_t activation, const float * gate, const float * up, int64_t n, act_t * out,
                            cudaStream_t stream);
// out[i] = x[i] for n elements into the step's activations (fp16 on the GPU): a matrix's input without a norm.
pebble_status to_act(const float * x, int64_t n, act_t * out, cudaStream_t stream);
// dst[r][j] = src[r * stride + j] for n_rows rows of `width` (a layer's slice of each token's per-layer inputs).
pebble_status gather_rows(const float * src, int64_t stride, int64_t n_rows, int64_t width, float * dst,
                          cudaStream_t stream);
// logits *= scale, then c * tanh(l / c) where cap > 0, for n logits.
pebble_status scale_logits(float * logits, int64_t n, float scale, float cap, cudaStream_t stream);

} // namespace pebble_internal

// cpu/cpu.h: what the host library's CPU kernels (cpu/) give the rest of the library: a persistent thread
// pool (cpu/pool.cc), products of GGUF-quantized weights with activations quantized once per call to 8-bit
// blocks, as llama.cpp's CPU backend computes them (cpu/matmul.cc, over cpu/matvec_*.cc), attention
// (cpu/attend.cc, cpu/attend_prompt.cc) and the gated activations (cpu/activations.cc). The host build's
// launchers under cuda/ hand their work to these; the one header of cpu/ they include. Only the host build
// (PEBBLE_HOST_BUILD) has them; not part of the ABI.
#pragma once

#include "pebble.h"

#include <cstdint>

namespace pebble_cpu {

// Calls fn(ctx, begin, end) over disjoint ranges that cover [0, n), on the pool's threads and the
// calling one when `work` (about one unit per multiply-add) pays for waking them, else on the calling
// thread alone. Returns when every range is done. Safe to call from several threads at once (a call
// that finds the pool busy runs its work on its own thread).
void parallel_ranges(int64_t n, int64_t work, void (*fn)(void * ctx, int64_t begin, int64_t end), void * ctx);

template <typename F>
void parallel_for(int64_t n, int64_t work, const F & f) {
    parallel_ranges(n, work, [](void * ctx, int64_t begin, int64_t end) { (*static_cast<const F *>(ctx))(begin, end); },
                    const_cast<void *>(static_cast<const void *>(&f)));
}

// PEBBLE_OK when the pool can be used, else the failure (a malformed PEBBLING_THREADS) through
// pebble_internal::fail, naming `fn`.
pebble_status check_threads(const char * fn);

// y[t * n_rows + r] = sum over c of W[r][c] * x[t][c] for t < n_tok (x fp16, or float32 rounded to fp16
// first where x_f32; n_tok vectors one after another), the arguments already checked. The quantized types
// multiply int8 blocks of x (see pebble.h); F32, F16 and BF16 weights take x as float32. Rows are split
// among the pool's threads; a tile of rows is multiplied by every vector before the next, so it is read
// from memory once.
// With exact_f32, float32 vectors reach F32, F16 and BF16 weights as they are, not rounded to fp16 first (the
// decode step's dense weights, multiplied as numpy multiplies them).
pebble_status matmul(int32_t ggml_type, const uint8_t * w, int64_t n_rows, int64_t n_cols, const void * x, bool x_f32,
                     int64_t n_tok, float * y, const char * fn, bool exact_f32 = false);

// One matrix of a matmul_parts call: n_rows rows of ggml_type at w, the products into y (n_tok rows of n_rows).
struct matmul_part {
    int32_t         ggml_type;
    const uint8_t * w;
    int64_t         n_rows;
    float *         y;
};
constexpr int max_matmul_parts = 4;

// matmul for 1..max_matmul_parts matrices of n_cols columns times the same vectors (a layer's q, k and v;
// its gate and up): x quantized once for each kind of activation the parts take, and every part's tiles in
// one pass of the pool, so that the threads wait for each other once, not once a matrix. Each part gets
// the bits matmul gives it alone.
pebble_status matmul_parts(const matmul_part * parts, int n_parts, int64_t n_cols, const void * x, bool x_f32,
                           int64_t n_tok, const char * fn, bool exact_f32 = false);

// pebble_attend (pebble.h), the arguments already checked: each (sequence, head) pair on one thread,
// scores in scratch (n_seq x n_head x n_rows floats), dot products and the weighted sum of V with SIMD.
// `sinks` (NULL: none): a logit per query head that joins its softmax and weights no value (gpt-oss).
pebble_status attend(int32_t n_seq, const float * q, int32_t kv_type, void * const * k_caches, void * const * v_caches,
                     const int64_t * n_pos, int64_t n_rows, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                     float scale, float softcap, float * out, float * scratch, const float * sinks = nullptr);

// pebble_attend_prompt (pebble.h), the arguments already checked: n_tok queries at positions pos.. of one
// sequence over its caches' rows 0..pos + n_tok - 1 (a query at p sees the keys at p and before, within
// `window` of it where window > 0), flash-attention style, tiles of queries on the pool's threads
// (cpu/attend_prompt.cc).
// `sinks` (NULL: none) as attend's.
pebble_status attend_prompt(const float * q, int64_t n_tok, int64_t pos, int32_t kv_type, const void * k_cache,
                            const void * v_cache, int32_t n_head, int32_t n_head_kv, int32_t head_dim, int64_t window,
                            float scale, float softcap, float * out, const float * sinks = nullptr);

// Whether PEBBLING_SIMD is 'gpu': pebble_matvec and the matmuls then run the GPU's integer and dense
// kernels' code for each lane on the host (cuda/matvec.cu host_q8_matvec, host_dense_matvec); the rest as 'auto'.
bool gpu_arithmetic();

// n (32 or 256) fp16 elements of x into d and q, as the quantized types' products quantize x (pebble.h).
void quantize(const uint16_t * x, int n, float & d, int8_t * q);

// The instruction set the kernels picked on this CPU: "avx512", "avx2" or "portable".
const char * simd_level();

// out[i] = silu(gate[i]) * up[i], or with GELU's tanh approximation in place of SiLU (activation 1), or
// gpt-oss's clamped SwiGLU (activation 2: pebble_layer_shape's), for n elements, among the pool's threads:
// eight at a time on AVX2 (exp by cpu/simd.h's polynomial), every element alike whatever n (a short last
// group is masked, not left to a scalar loop), as a batch needs.
void gated(int32_t activation, const float * gate, const float * up, int64_t n, float * out);

} // namespace pebble_cpu

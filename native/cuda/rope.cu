// cuda/rope.cu: a decode step's q, k and v between their projections and attention: biases added (F32 or
// F16), RoPE applied to q and k at each sequence's position (pairs rotated NeoX-style or interleaved, over
// the first rope_dims of each head, from the model's cos and sin tables), and the new K and V rows stored
// into the caches (F32, F16, Q8_0 or Q4_0: pebble_kv.h), a ring's row pos % rows. On the GPU one launch of
// each kernel takes a group of sequences; the host spreads the sequences over its threads, each through
// qkv_rows (the kernel's arithmetic head by head) or, without SIMD, through the GPU's kernel itself.

#include "cuda/common.cuh"
#include "cuda/ops.cuh"
#include "pebble_kv.h"

#include <algorithm>
#include <cstdint>

using namespace pebble_internal;

namespace {

// The dim that dim d of a head is rotated with (itself past rope_dims, where sin is 0).
__host__ __device__ inline int64_t rope_partner(int64_t d, int32_t rope_dims, int32_t neox) {
    if (d >= rope_dims) return d;
    if (!neox) return d ^ 1;
    const int32_t half = rope_dims / 2;
    return d < half ? d + half : d - half;
}

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

} // namespace

// ---------------------------------------------------------------------------------------------------
// launcher (cuda/ops.cuh)

namespace pebble_internal {

pebble_status rope_and_store(int32_t n, const qkv_args * qkv, const kv_row_args * kv_rows,
                             [[maybe_unused]] cudaStream_t stream) {
    const int64_t q = qkv[0].n_q, kv = kv_rows[0].n_kv;
#ifdef PEBBLE_HOST_BUILD
    // The sequences' biases, RoPE and new cache rows among the pool's threads (a few microseconds each);
    // through the GPU's own kernel, the same bits, where host_runs_gpu_kernels.
    const bool portable = host_runs_gpu_kernels();
    pebble_cpu::parallel_for(n, int64_t(n) * (q + 2 * kv) * qkv_work_per_value, [&](int64_t first, int64_t end) {
        for (int64_t b = first; b < end; b++) {
            if (portable) {
                arg_group<qkv_args> one{};
                one.n = 1;
                one.a[0] = qkv[b];
                qkv_kernel(one);
            } else {
                qkv_rows(qkv[b]);
            }
            kv_row(kv_rows[b]);
        }
    });
#else
    const int32_t kv_type = kv_rows[0].type;
    const int32_t group = switches().group;
    for (int32_t first = 0; first < n; first += group) { // the sequences in groups, a launch each
        arg_group<qkv_args> qg{};
        arg_group<kv_row_args> kg{};
        qg.n = kg.n = std::min(group, n - first);
        for (int32_t b = 0; b < qg.n; b++) {
            qg.a[b] = qkv[first + b];
            kg.a[b] = kv_rows[first + b];
        }
        LAUNCH(qkv_kernel, dim3(grid_for(q + 2 * kv, threads), unsigned(qg.n)), threads, stream, qg);
        TRY(launched());
        LAUNCH(kv_row_kernel, dim3(grid_for(2 * kv_units(kv_type, kv), threads), unsigned(kg.n)), threads, stream, kg);
        TRY(launched());
    }
#endif
    return PEBBLE_OK;
}

} // namespace pebble_internal

// cuda/common.cuh: what the sources under cuda/ share: how a kernel is launched (on the GPU's stream, or
// called as one thread in the host build, which hands some launches to the CPU's kernels instead), the
// sizes of launches, the GPU decode path's run-time switches, the decode step's activations (float32 in
// the host build, fp16 on the GPU) and loads of F32 or F16 vectors. Not part of the ABI.
#pragma once

#include "pebble_device.h"
#include "pebble_internal.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef PEBBLE_HOST_BUILD
#    include "cpu/cpu.h"
#endif

namespace pebble_internal {

// The GPU decode path's run-time switches, read once from the environment (README: PEBBLING_CUDA_*): each
// puts back the way a step ran before, to compare the two on a GPU or to go on where the new way is in
// doubt. A value other than those below leaves the default (pyplugin refuses it before the library runs).
constexpr int32_t max_launch_group = 8; // the most sequences one launch of a per-sequence kernel takes
struct cuda_switches {
    bool    integer_matvec; // PEBBLING_CUDA_MATVEC=float: false, x in fp16 (default: 8-bit x, dp4a)
    bool    persist;        // PEBBLING_CUDA_PERSIST=0: false, x staged a row group at a time (default 1)
    bool    stack;          // PEBBLING_CUDA_STACK=0: false, one launch a matrix (default 1: q/k, gate/up)
    int32_t group;          // PEBBLING_CUDA_GROUP=1..8: sequences a launch of a per-sequence kernel takes (8)
    bool    split;          // PEBBLING_CUDA_SPLIT=0: false, the attention as it ran on 11-27 (a lane a row's
                            // score, a warp a head's softmax, V summed in one pass a head and 32 dims; default
                            // 1: a warp a KV head and row's scores, V in parts of PEBBLE_DECODER_SPLIT_ROWS rows
                            // each with its own softmax, then the parts put together)
    bool    dense;          // PEBBLING_CUDA_DENSE=0: false, F16, BF16 and F32 matvec an element a lane's part
                            // (default 1: eight, in 16-byte loads: matvec_dense_kernel)
};
const cuda_switches & switches();
constexpr int64_t max_grid = int64_t(1) << 20; // thread blocks that fill any GPU; grid-stride loops do the rest
#ifndef PEBBLE_HOST_BUILD
// The thread blocks of `kernel` (of `threads` threads) the device holds at once: its multiprocessors times
// the blocks one of them holds (its registers and shared memory decide); max_grid where the runtime cannot say.
template <typename K> int64_t resident_blocks(K kernel, int threads) {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess || sms * per_sm < 1) {
        cudaGetLastError(); // not an error of the launch that follows
        return max_grid;
    }
    return int64_t(sms) * per_sm;
}
// PEBBLE_OK unless `ptr` is pageable host memory, which a kernel cannot read.
pebble_status check_device_pointer(const void * ptr, const char * what, const char * fn);
// A kernel of a quantized type (pebble_dequantize, pebble_matvec) about to read `ptr`: the same check,
// the type named in the message (cuda/common.cu).
pebble_status check_reachable(const void * ptr, const char * what, const char * fn, int32_t ggml_type);
// PEBBLE_OK unless the launch just made (of a kernel of `ggml_type`, by `fn`) failed.
pebble_status check_launch(const char * fn, int32_t ggml_type);
#endif

#ifdef PEBBLE_HOST_BUILD
// f(begin, end) over [0, n), on the host's thread pool when there is enough work (`work` elements) to
// pay for waking it (cpu/pool.cc). The shares are disjoint, so the results are those of one thread.
template <typename F>
void host_parallel(int64_t n, int64_t work, F && f) {
    pebble_cpu::parallel_for(n, work, f);
}
#endif

// ---------------------------------------------------------------------------------------------------
// launches

#ifdef PEBBLE_HOST_BUILD
#    define LAUNCH(kernel, grid, block, stream, ...) kernel(__VA_ARGS__)
inline pebble_status launched() { return PEBBLE_OK; }
#else
#    define LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
inline pebble_status launched() {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        return fail(PEBBLE_ERR_CUDA, "a kernel could not be launched: %s", cudaGetErrorString(err));
    }
    return PEBBLE_OK;
}
#endif

constexpr int     threads = 256;
constexpr int     heads_per_block = 4;

[[maybe_unused]] inline unsigned grid_for(int64_t n, int64_t per_block) {
    return static_cast<unsigned>(std::max<int64_t>(1, std::min(max_grid, (n + per_block - 1) / per_block)));
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

// ---------------------------------------------------------------------------------------------------
// vectors and activations

constexpr int32_t f32_type = 0, f16_type = 1;

__host__ __device__ inline float load_value(const void * p, int32_t type, int64_t i) {
    return type == f32_type ? static_cast<const float *>(p)[i] : half_to_float(static_cast<const uint16_t *>(p)[i]);
}

// The decode step's activations, what its matrix products read: float32 in the host build (whose kernels
// round them to fp16 for quantized weights and take them as they are for dense ones, as the forward pass
// does), fp16 on the GPU.
#ifdef PEBBLE_HOST_BUILD
// Whether the host runs the GPU's own kernels where it has SIMD code of its own (qkv_rows, cpu/attend.cc's
// attend): without SIMD (PEBBLING_SIMD=portable), so that the host's tests hold those kernels to the
// forward pass too.
inline bool host_runs_gpu_kernels() {
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

} // namespace pebble_internal

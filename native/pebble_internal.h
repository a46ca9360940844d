// pebble_internal.h: what pebble.cu shares with the library's other sources; not part of the ABI.
//
// The per-thread last error lives in pebble.cu; the other sources report through the same `fail`, so
// pebble_last_error() describes a failed kernel call exactly as it does a failed store call.
#pragma once

#include "pebble.h"

#ifdef PEBBLE_HOST_BUILD
#    include "cuda_host.h"
#else
#    include <cuda_runtime.h>
#endif

namespace pebble_internal {

// Records a printf-style message for pebble_last_error() on the calling thread and returns `status`.
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
pebble_status fail(pebble_status status, const char * fmt, ...);

// From pebble_quant.cu, for the decode step (pebble_decode.cu):
// the GGUF name of a type id ("?" for ids without a type);
const char * ggml_type_name(int32_t ggml_type);
// the elements and bytes of one block of a type with kernels (false, nothing written, for another type);
bool type_block(int32_t ggml_type, int64_t * block_elements, int64_t * block_bytes);
// PEBBLE_OK when `ggml_type` has kernels and n_rows x n_cols are whole rows of its blocks, else a failure
// naming `fn` and `what`;
pebble_status check_matrix(const char * fn, const char * what, int32_t ggml_type, int64_t n_rows, int64_t n_cols);
// y = W x for one fp16 vector, arguments already checked, enqueued on `stream`;
pebble_status matvec_one(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const uint16_t * x,
                         float * y, cudaStream_t stream);
// Y = W X for n_vec vectors one after another (y likewise), arguments already checked, on `stream`: the decode
// step's activations, float32 in the host build (rounded to fp16 for quantized weights, as they are for dense
// ones: pebble_cpu::matmul's exact_f32) and fp16 in the CUDA build;
pebble_status matvec_many(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const void * x,
                          int64_t n_vec, float * y, cudaStream_t stream);
// matvec_many for up to 4 matrices of n_cols columns times the same vectors: on the host one pass of the
// CPU's threads for them all (pebble_cpu::matmul_parts), on the GPU one launch each;
struct matvec_part {
    int32_t      ggml_type;
    const void * w;
    int64_t      n_rows;
    float *      y;
};
pebble_status matvec_parts(const matvec_part * parts, int n_parts, int64_t n_cols, const void * x, int64_t n_vec,
                           cudaStream_t stream);
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
#endif

} // namespace pebble_internal

// Records the statement, function, file and line of a failed runtime call and returns a status.
#define CUDA_CHECK(stmt)                                                                           \
    do {                                                                                           \
        cudaError_t err_ = (stmt);                                                                 \
        if (err_ != cudaSuccess) {                                                                 \
            return pebble_internal::fail(                                                          \
                err_ == cudaErrorMemoryAllocation ? PEBBLE_ERR_DEVICE_OOM : PEBBLE_ERR_CUDA,       \
                "%s: %s failed: %s (%s:%d)", __func__, #stmt, cudaGetErrorString(err_), __FILE__,  \
                __LINE__);                                                                         \
        }                                                                                          \
    } while (0)

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        pebble_status st_ = (expr);                                                                \
        if (st_ != PEBBLE_OK) return st_;                                                          \
    } while (0)

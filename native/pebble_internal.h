// pebble_internal.h: what every part of the library shares (the store, cuda/ and cpu/); not part of the ABI.
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

// From cuda/quants.cu, for the store's checks, the decode step and the CPU kernels' messages:
// the GGUF name of a type id ("?" for ids without a type);
const char * ggml_type_name(int32_t ggml_type);
// the elements and bytes of one block of a type with kernels (false, nothing written, for another type).
bool type_block(int32_t ggml_type, int64_t * block_elements, int64_t * block_bytes);

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

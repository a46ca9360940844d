// cuda/dequantize.cu: tensors of every type with kernels (cuda/quants.cuh) expanded from their GGUF
// blocks. pebble_dequantize expands a tensor to fp16 on the device: prefill expands one layer at a time
// into a reused workspace that cuBLAS multiplies; one thread decodes one part of a block, and on the GPU
// a thread block stores its stretch of the output in 4-byte words. pebble_dequantize_rows expands chosen
// rows of a table (an embedding's) to float32 on the host. The values are gguf-py's dequantize's, bit for
// bit. In the host build (-DPEBBLE_HOST_BUILD) a kernel is a plain function that loops over its share of
// the work, the launcher splitting blocks among the host's thread pool when there are enough of them.

#include "cuda/common.cuh"
#include "cuda/quants.cuh"

#include <algorithm>
#include <cinttypes>
#include <cstdint>

using namespace pebble_internal;

namespace {

// ---------------------------------------------------------------------------------------------------
// kernels

// One thread per part of a block, grid-strided.
template <typename T>
__global__ void dequantize_kernel(const uint8_t * __restrict__ src, uint16_t * __restrict__ dst, int64_t n_parts) {
    for (int64_t p = grid_thread(); p < n_parts; p += grid_threads()) {
        const int64_t block = p / T::parts;
        uint16_t * out = dst + block * T::block_elements;
        auto emit = [out](int i, float value) { out[i] = half_from_float(value); };
        T::decode(src + block * T::block_bytes, static_cast<int>(p % T::parts), emit);
    }
}

#ifndef PEBBLE_HOST_BUILD
constexpr int dequantize_threads = 256;

// dequantize_kernel for block types (32 or more elements a part): a thread block's parts are
// consecutive, so their elements are one stretch of the output; each thread decodes its part into shared
// memory and the block then stores the stretch in 4-byte words, consecutive threads consecutive words.
// (Stored where they were decoded, each thread's 2-byte stores landed 64 or 128 bytes from its
// neighbours', 32 lines a warp-wide store: about 180 GB/s on an H200.) The same halves, bit for bit.
template <typename T>
__global__ void __launch_bounds__(dequantize_threads)
dequantize_tiled_kernel(const uint8_t * __restrict__ src, uint16_t * __restrict__ dst, int64_t n_parts) {
    constexpr int part_elements = T::block_elements / T::parts, tile = dequantize_threads * part_elements;
    static_assert(part_elements % 64 == 0 || part_elements == 32, "parts of whole padding groups or half of one");
    static_assert(dequantize_threads % T::parts == 0, "a tile is whole blocks");
    __shared__ __align__(16) uint16_t staged[tile + 2 * (tile / 64)];
    for (int64_t first = int64_t(blockIdx.x) * dequantize_threads; first < n_parts;
         first += int64_t(gridDim.x) * dequantize_threads) {
        const int64_t p = first + threadIdx.x, tile_start = first * part_elements;
        if (p < n_parts) {
            const int64_t block = p / T::parts;
            const int offset = static_cast<int>(block * T::block_elements - tile_start); // the block's element 0
            auto emit = [&](int i, float value) { staged[staged_at<2>(offset + i)] = half_from_float(value); };
            T::decode(src + block * T::block_bytes, static_cast<int>(p % T::parts), emit);
        }
        __syncthreads();
        const int64_t parts_here = n_parts - first < dequantize_threads ? n_parts - first : dequantize_threads;
        const int words = static_cast<int>(parts_here * part_elements / 2);
        const uint32_t * from = reinterpret_cast<const uint32_t *>(staged);
        uint32_t * to = reinterpret_cast<uint32_t *>(dst + tile_start);
        for (int w = threadIdx.x; w < words; w += dequantize_threads) to[w] = from[w + (w >> 5)];
        __syncthreads(); // the stretch is out before the next one is decoded into the same memory
    }
}
#endif

// ---------------------------------------------------------------------------------------------------
// launcher

template <typename T>
pebble_status launch_dequantize(const uint8_t * src, uint16_t * dst, int64_t n_blocks, cudaStream_t stream) {
    if constexpr (T::id == type_f16::id) { // already fp16: a copy keeps every bit, NaN payloads included
        CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n_blocks) * T::block_bytes, cudaMemcpyDefault,
                                   stream));
        return PEBBLE_OK;
    }
    const int64_t n_parts = n_blocks * T::parts;
#ifdef PEBBLE_HOST_BUILD
    (void)n_parts;
    host_parallel(n_blocks, n_blocks * T::block_elements, [=](int64_t begin, int64_t end) {
        dequantize_kernel<T>(src + begin * T::block_bytes, dst + begin * T::block_elements, (end - begin) * T::parts);
    });
    return PEBBLE_OK;
#else
    const int64_t grid = std::min(max_grid, (n_parts + dequantize_threads - 1) / dequantize_threads);
    if constexpr (T::block_elements / T::parts >= 32) {
        if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) { // it stores 4-byte words
            dequantize_tiled_kernel<T><<<static_cast<unsigned>(grid), dequantize_threads, 0, stream>>>(src, dst, n_parts);
            return check_launch("pebble_dequantize", T::id);
        }
    }
    dequantize_kernel<T><<<static_cast<unsigned>(grid), dequantize_threads, 0, stream>>>(src, dst, n_parts);
    return check_launch("pebble_dequantize", T::id);
#endif
}

} // namespace

// ---------------------------------------------------------------------------------------------------
// quantized tensors

extern "C" pebble_status pebble_dequantize(int32_t ggml_type, const void * src, uint64_t src_bytes,
                                           uint16_t * dst_f16, int64_t n_elements, void * stream) {
    return with_type(ggml_type, __func__, [&](auto t) {
        using T = decltype(t);
        const char * name = type_name(T::id);
        // The count first: with no elements, a caller's empty buffer may well be NULL.
        if (n_elements < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize: %s: n_elements must be at least 1, got %"
                        PRId64, name, n_elements);
        }
        if (!src || !dst_f16) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize: %s: src and dst_f16 must not be NULL "
                        "(src %p, dst_f16 %p)", name, src, static_cast<void *>(dst_f16));
        }
        if (n_elements % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize: %s: n_elements %" PRId64 " is not a multiple "
                        "of the %d-element block", name, n_elements, T::block_elements);
        }
        const int64_t n_blocks = n_elements / T::block_elements;
        if (n_blocks > INT64_MAX / T::block_bytes) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize: %s: %" PRId64 " elements take more than "
                        "2^63 bytes", name, n_elements);
        }
        const uint64_t want = static_cast<uint64_t>(n_blocks) * T::block_bytes;
        if (src_bytes != want) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize: %s: %" PRId64 " elements are %" PRId64
                        " blocks of %d bytes = %" PRIu64 " bytes, but src_bytes is %" PRIu64, name, n_elements,
                        n_blocks, T::block_bytes, want, src_bytes);
        }
#ifndef PEBBLE_HOST_BUILD
        TRY(check_reachable(src, "src", "pebble_dequantize", T::id));
        TRY(check_reachable(dst_f16, "dst_f16", "pebble_dequantize", T::id));
#endif
        return launch_dequantize<T>(static_cast<const uint8_t *>(src), dst_f16, n_blocks,
                                    static_cast<cudaStream_t>(stream));
    });
}

namespace {
// decode's emit for pebble_dequantize_rows (a lambda here would be host code called from host-device code)
struct float_store {
    float * out;
    __host__ __device__ void operator()(int i, float value) const { out[i] = value; }
};
} // namespace

extern "C" pebble_status pebble_dequantize_rows(int32_t ggml_type, const void * table, uint64_t table_bytes,
                                                int64_t n_cols, const int64_t * rows, int64_t n_rows, float * out) {
    return with_type(ggml_type, __func__, [&](auto t) -> pebble_status {
        using T = decltype(t);
        const char * name = type_name(T::id);
        if (n_rows < 0 || n_cols < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: n_cols must be at least 1 and "
                        "n_rows at least 0, got %" PRId64 " and %" PRId64, name, n_cols, n_rows);
        }
        if (n_rows == 0) return PEBBLE_OK;
        if (!table || !rows || !out) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: table, rows and out must not be "
                        "NULL (table %p, rows %p, out %p)", name, table, static_cast<const void *>(rows),
                        static_cast<void *>(out));
        }
        if (n_cols % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize_rows: %s: n_cols %" PRId64 " is not a multiple "
                        "of the %d-element block", name, n_cols, T::block_elements);
        }
        const int64_t blocks = n_cols / T::block_elements;
        if (blocks > INT64_MAX / T::block_bytes || n_rows > INT64_MAX / n_cols) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize_rows: %s: %" PRId64 " rows of %" PRId64
                        " elements overflow 64-bit sizes", name, n_rows, n_cols);
        }
        const uint64_t row_bytes = static_cast<uint64_t>(blocks) * T::block_bytes;
        if (table_bytes % row_bytes != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "pebble_dequantize_rows: %s: table_bytes %" PRIu64 " is not a "
                        "whole number of %" PRIu64 "-byte rows of %" PRId64 " elements", name, table_bytes, row_bytes,
                        n_cols);
        }
        const int64_t table_rows = static_cast<int64_t>(table_bytes / row_bytes);
        for (int64_t r = 0; r < n_rows; r++) { // all checked before any is written
            if (rows[r] < 0 || rows[r] >= table_rows) {
                if (table_rows == 0) {
                    return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: rows[%" PRId64 "] is %"
                                PRId64 "; the table is empty (table_bytes 0): it has no rows to take", name, r, rows[r]);
                }
                return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_dequantize_rows: %s: rows[%" PRId64 "] is %" PRId64
                            "; the table has rows 0..%" PRId64, name, r, rows[r], table_rows - 1);
            }
        }
        for (int64_t r = 0; r < n_rows; r++) {
            const uint8_t * src = static_cast<const uint8_t *>(table) + static_cast<uint64_t>(rows[r]) * row_bytes;
            float * dst = out + r * n_cols;
            for (int64_t b = 0; b < blocks; b++) {
                float_store emit{dst + b * T::block_elements};
                for (int part = 0; part < T::parts; part++) T::decode(src + b * T::block_bytes, part, emit);
            }
        }
        return PEBBLE_OK;
    });
}

// cpu/matmul.cc: y = W x on the CPU for weights of every type with kernels and any number of vectors
// (pebble_cpu::matmul, and matmul_parts for up to 4 matrices times the same vectors in one pass of the
// pool): x laid out once for the type's kernels (cpu/quantize.cc), then tiles of rows among the pool's
// threads, each tile multiplied by every vector before the next so it is read from memory once, whole
// groups of 16 rows through a type's sixteen-row kernels where it has them. Decode on a CPU reads every
// weight once per token, so its speed is the speed of reading quantized bytes and multiplying them
// without expanding them to float; the row kernels, family by family, are cpu/matvec_32.cc's,
// cpu/matvec_k.cc's and cpu/matvec_float.cc's, chosen for this CPU once per type.

#include "cpu/cpu.h"
#include "cpu/quants.h"
#include "pebble_internal.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>

using pebble_internal::fail;

namespace pebble_cpu {
namespace {

// The kernels of a GGUF type id on this CPU; block_elements 0 for a type without them (the callers have
// refused those already).
kernel_set kernels_for(int32_t type) {
    const simd level = simd_in_use();
    switch (type) {
        case 0: case 1: case 30:                return float_kernels(type, level);
        case 2: case 3: case 6: case 7: case 8: case 20: case 39: return block32_kernels(type, level);
        case 12: case 13: case 14:                               return k_quant_kernels(type, level);
        case 10: case 11: case 23:                               return low_bit_kernels(type, level);
    }
    return {act::f32, 0, 0, 0, {}, {}};
}

// One call's work: W (n_rows rows of row_bytes) times n_tok activations of xs bytes each.
struct matmul_job {
    const kernel_set * k;
    const uint8_t *    w;
    int64_t            row_bytes, nb, n_rows, n_tok;
    const uint8_t *    xq;
    int64_t            xs;
    float *            y;
    int64_t            tile_rows;
};

// Tiles [begin, end) of tile_rows rows each: every activation (the kernel set's nv at a time) through the
// tile's rows, so that the tile stays in cache while they pass.
// How far ahead of the row multiplied its thread asks memory for the rows to come: a decode step reads
// each weight once, from memory, and the hardware's prefetcher alone left half the bandwidth unused.
constexpr int64_t prefetch_bytes = 8192;

inline void prefetch_row(const uint8_t * row, int64_t nbytes) {
    for (int64_t o = 0; o < nbytes; o += 64) __builtin_prefetch(row + o, 0, 3);
}

void matmul_tiles(void * ctx, int64_t begin, int64_t end) {
    const matmul_job & j = *static_cast<const matmul_job *>(ctx);
    const int64_t r0 = begin * j.tile_rows, r1 = std::min(j.n_rows, end * j.tile_rows);
    const int64_t ahead = (prefetch_bytes + j.row_bytes - 1) / j.row_bytes;
    // a prompt's vectors through sixteen rows at once, where the set has a kernel for it (cpu/quants.h's prompt_frame)
    const bool many = j.k->many && j.n_tok > j.k->nv && j.row_bytes <= INT32_MAX / group_rows;
    for (int64_t rt = r0; rt < r1; rt += j.tile_rows) {
        const int64_t rt_end = std::min(r1, rt + j.tile_rows);
        const int64_t whole = many ? rt + (rt_end - rt) / group_rows * group_rows : rt; // the rows many took
        for (int64_t r = rt; r < whole; r += group_rows) {
            j.k->many(j.w + r * j.row_bytes, j.row_bytes, j.nb, j.xq, j.xs, j.n_tok, j.y + r, j.n_rows);
        }
        for (int64_t t = 0; t < j.n_tok && whole < rt_end; t += j.k->nv) {
            const int nv = static_cast<int>(std::min<int64_t>(j.k->nv, j.n_tok - t));
            int64_t r = whole; // whole groups of 16 rows first where the set has rows kernels, then row by row
            // (the 32-element types gather each row's first dword at 32-bit offsets: rows of under 128 MiB)
            if (const rows_fn rows = j.k->rows[nv - 1]; rows && j.row_bytes <= INT32_MAX / group_rows) {
                for (; r + group_rows <= rt_end; r += group_rows) {
                    rows(j.w + r * j.row_bytes, j.row_bytes, j.nb, j.xq + t * j.xs, j.xs, j.y + t * j.n_rows + r, j.n_rows);
                }
            }
            for (; r < rt_end; r++) {
                float out[max_nv];
                if (t == 0 && r + ahead < r1) prefetch_row(j.w + (r + ahead) * j.row_bytes, j.row_bytes);
                j.k->dot[nv - 1](j.w + r * j.row_bytes, j.nb, j.xq + t * j.xs, j.xs, out);
                for (int v = 0; v < nv; v++) j.y[(t + v) * j.n_rows + r] = out[v];
            }
        }
    }
}

template <int... T> std::array<kernel_set, sizeof...(T)> every_type(std::integer_sequence<int, T...>) {
    return {kernels_for(T)...};
}

const kernel_set & kernels_of(int32_t ggml_type) {
    static const std::array<kernel_set, PEBBLE_TYPE_COUNT> sets = every_type(std::make_integer_sequence<int, PEBBLE_TYPE_COUNT>{});
    return sets[ggml_type];
}

// The job of one matrix: tiles of rows small enough that the threads share decode's few rows evenly, large
// enough that a prefill tile is read once for many activations; and what the pool judges it by (*work): a
// prefill's multiply-adds; a decode call's weights, four times over whatever its number of vectors (each
// row is one pass for all of them), so that a matrix of 2^18 weights or more is split: a single request's
// 512 x 512 product ran 1.5x faster on two threads, while a 128 x 384 matrix times 8 vectors ran faster on
// one.
matmul_job job_of(const kernel_set & k, const uint8_t * w, int64_t n_rows, int64_t n_cols, int64_t n_tok,
                  const uint8_t * xq, int64_t xs, float * y, int64_t * tiles, int64_t * work) {
    const int64_t nb = n_cols / k.block_elements, row_bytes = nb * k.block_bytes;
    int64_t tile_rows = n_tok > k.nv ? std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(row_bytes, 1)) : 8;
    tile_rows = std::clamp<int64_t>(tile_rows, 1, 64);
    if (k.rows[k.nv - 1]) tile_rows = (tile_rows + group_rows - 1) / group_rows * group_rows; // whole groups
    *tiles = (n_rows + tile_rows - 1) / tile_rows;
    *work = n_tok > k.nv ? n_rows * n_cols * n_tok : n_rows * n_cols * 4;
    return matmul_job{&k, w, row_bytes, nb, n_rows, n_tok, xq, xs, y, tile_rows};
}

} // namespace

pebble_status matmul(int32_t ggml_type, const uint8_t * w, int64_t n_rows, int64_t n_cols, const void * x, bool x_f32,
                     int64_t n_tok, float * y, const char * fn, bool exact_f32) {
    const matmul_part part{ggml_type, w, n_rows, y};
    return matmul_parts(&part, 1, n_cols, x, x_f32, n_tok, fn, exact_f32);
}

pebble_status matmul_parts(const matmul_part * parts, int n_parts, int64_t n_cols, const void * x, bool x_f32,
                           int64_t n_tok, const char * fn, bool exact_f32) {
    TRY(check_threads(fn));
    if (n_parts < 1 || n_parts > max_matmul_parts) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %d matrices in one product; 1 to %d are accepted", fn,
                    n_parts, max_matmul_parts);
    }
    struct parts_job {
        matmul_job jobs[max_matmul_parts];
        int64_t    first_tile[max_matmul_parts + 1]; // part p's tiles are [first_tile[p], first_tile[p + 1])
        int        n;
    } job{};
    uint8_t * xq[max_matmul_parts] = {};
    int64_t xs[max_matmul_parts] = {}, work = 0;
    pebble_status status = PEBBLE_OK;
    job.n = n_parts;
    for (int p = 0; p < n_parts && status == PEBBLE_OK; p++) {
        const kernel_set & k = kernels_of(parts[p].ggml_type);
        if (k.block_elements == 0) {
            status = fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s has no CPU kernels", fn,
                          pebble_internal::ggml_type_name(parts[p].ggml_type));
            break;
        }
        // x quantized once per kind of activation the parts take
        int same = -1;
        for (int e = 0; e < p && same < 0; e++) same = job.jobs[e].k->activation == k.activation ? e : -1;
        if (same >= 0) {
            xq[p] = nullptr;
            xs[p] = xs[same];
        } else {
            status = quantize_x(k, parts[p].ggml_type, n_cols, x, x_f32, n_tok, exact_f32, fn, &xq[p], &xs[p]);
            if (status != PEBBLE_OK) break;
        }
        int64_t tiles = 0, part_work = 0;
        job.jobs[p] = job_of(k, parts[p].w, parts[p].n_rows, n_cols, n_tok, same >= 0 ? job.jobs[same].xq : xq[p],
                             xs[p], parts[p].y, &tiles, &part_work);
        job.first_tile[p + 1] = job.first_tile[p] + tiles;
        work += part_work;
    }
    if (status == PEBBLE_OK) {
        parallel_ranges(job.first_tile[n_parts], work, [](void * ctx, int64_t begin, int64_t end) {
            const parts_job & j = *static_cast<const parts_job *>(ctx);
            for (int p = 0; p < j.n; p++) {
                const int64_t b = std::max(begin, j.first_tile[p]), e = std::min(end, j.first_tile[p + 1]);
                if (b < e) matmul_tiles(const_cast<matmul_job *>(&j.jobs[p]), b - j.first_tile[p], e - j.first_tile[p]);
            }
        }, &job);
    }
    for (int p = 0; p < n_parts; p++) std::free(xq[p]);
    return status;
}

} // namespace pebble_cpu

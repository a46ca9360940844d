// cuda/attention.cu: attention of one query per head over a sequence's KV cache (F32, F16, Q8_0 or Q4_0:
// pebble_kv.h), soft-capped where asked, for a decode step's sequences and for pebble_attend (which also
// stores the new K and V rows first); and pebble_attend_prompt, a prompt chunk's causal attention, which the
// host library computes on the CPU (cpu/attend_prompt.cc) and the cuda library leaves to array operations.
// On the GPU in passes that each spread over it: scores, then V weighted in parts of rows each with its
// own softmax, the parts put together after (flash-decoding). The host library attends with its CPU
// kernels (cpu/attend.cc), and runs these kernels in turn, as one thread, where it has no SIMD.

#include "cuda/common.cuh"
#include "cuda/ops.cuh"
#include "pebble_kv.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>

using namespace pebble_internal;

namespace {

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
            if (a.sinks) top = fmaxf(top, a.sinks[h]); // gpt-oss's sink: in the largest and the sum, no value
            float total = 0.0f;
            for (int64_t s = warp_lane(); s < n_pos; s += warp_lanes) {
                sc[s] = expf(sc[s] - top);
                total += sc[s];
            }
            total = warp_sum(total);
            if (a.sinks) total += expf(a.sinks[h] - top);
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
            if (a.sinks) top = fmaxf(top, a.sinks[h]);
            const float shift = top == -INFINITY ? 0.0f : top;
            float acc = 0.0f, total = a.sinks ? expf(a.sinks[h] - shift) : 0.0f;
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

} // namespace

// ---------------------------------------------------------------------------------------------------
// launcher (cuda/ops.cuh)

namespace pebble_internal {

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

} // namespace pebble_internal

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
                              n_rows, scale, softcap, nullptr, static_cast<float *>(scratch) + int64_t(b) * n_head * n_rows,
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
                                              float softcap, const float * sinks, float * out, void * stream_ptr) {
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
                                     scale, softcap, out, sinks);
#else
    (void)stream_ptr;
    return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_attend_prompt: the cuda library does not attend prompts yet; "
                "attend them with array operations on the device (the host library has this call)");
#endif
}

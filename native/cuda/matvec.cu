// cuda/matvec.cu: y = W x for weights of every type with kernels (cuda/quants.cuh): pebble_matvec (1..8
// fp16 vectors), pebble_matmul (any number), pebble_matmul_f32 (float32 x, rounded to fp16 first), and the
// decode step's products (matvec_one, matvec_many, matvec_parts: cuda/ops.cuh). In decode, reading the
// weights is the whole cost, so each block is read once and decoded in registers. Three kernels: every
// quantized type through 8-bit x and integer dot products (matvec_q8_kernel), F16, BF16 and F32 in 16-byte
// loads (matvec_dense_kernel), and each weight decoded to float (matvec_kernel: PEBBLING_CUDA_MATVEC=float,
// and shapes the others do not take); their per-type inner loops are cuda/vecdot.cuh's.
//
// The host build's products are not these kernels: they are the CPU's (cpu/matmul.cc), which quantize x
// to 8-bit blocks and multiply with integer SIMD dot products, as llama.cpp's CPU backend does (pebble.h
// says what that changes in the results); with PEBBLING_SIMD=gpu it runs the GPU integer and dense kernels'
// code for each lane instead (host_q8_matvec, host_dense_matvec).

#include "cuda/common.cuh"
#include "cuda/ops.cuh"
#include "cuda/quants.cuh"
#include "cuda/vecdot.cuh"

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>

using namespace pebble_internal;

namespace {

// ---------------------------------------------------------------------------------------------------
// kernels

// One warp per row (blockDim = 32 x rows per block, rows grid-strided). The lanes take the row's block
// parts in turn, so at each step the warp reads one contiguous stretch of the row, every byte of it
// once; each lane keeps NV float32 sums, reduced across the warp by shuffles at the end of the row.
// x (fp16) goes through shared memory a chunk of matvec_chunk elements at a time, loaded once for the
// thread block's rows by coalesced reads: read from global memory where it is used, each warp-wide
// load of x touched 32 lines (the lanes are a part apart), and those loads, not the weights, set the
// time. One 4-byte word of padding every 64 elements puts the lanes' reads in different banks (a lane's
// part is 32 or 64 elements). A chunk is whole rounds of the warp's parts, so each lane takes the parts
// it would take reading x from global memory, in the same order: the same sums, bit for bit.
// (The host build multiplies in cpu/matmul.cc instead, but for PEBBLING_SIMD=gpu: see host_q8_matvec.)

#ifndef PEBBLE_HOST_BUILD

// Row `row` of y for each of the NV vectors: the sum of the warp's lanes' acc, stored by lane 0 (every
// lane of the warp takes part in the shuffles).
template <int NV>
__device__ inline void store_row_sums(const float (&acc)[NV], int lane, float * __restrict__ y, int64_t n_rows,
                                      int64_t row) {
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const float sum = warp_sum(acc[v]);
        if (lane == 0) y[v * n_rows + row] = sum;
    }
}

// Up to max_stacked matrices of one type and width, times the same vectors, as one: part p's rows are
// rows first[p] .. first[p + 1] - 1 of the stack, its products y[p] (a step's q and k, or its gate and up,
// in one launch, staging x once for both).
constexpr int max_stacked = 4;
struct stacked_rows {
    const uint8_t * w[max_stacked];
    float *         y[max_stacked];
    int64_t         first[max_stacked + 1];
    int32_t         n;
};

// Row `row` of the stack: its matrix's row (w_row), where its sums go (y, of rows rows), and which row there.
struct stacked_row {
    const uint8_t * w_row;
    float *         y;
    int64_t         rows, row;
};

// (The parts are tried in an unrolled loop: indexed by a run-time part, the parameter was copied to each
// thread's stack, 112 bytes.)
__device__ inline stacked_row locate(const stacked_rows & m, int64_t row, int64_t row_bytes) {
    stacked_row at = {m.w[0] + row * row_bytes, m.y[0], m.first[1], row};
    PEBBLE_UNROLL
    for (int p = 1; p < max_stacked; p++) {
        if (p < m.n && row >= m.first[p]) {
            const int64_t local = row - m.first[p];
            at = {m.w[p] + local * row_bytes, m.y[p], m.first[p + 1] - m.first[p], local};
        }
    }
    return at;
}

#endif

#ifndef PEBBLE_HOST_BUILD
// Both kernels' work (matvec_kernel, matvec_dense_kernel): Dense, the parts of dense_parts (F16, BF16, F32
// only); else T::decode's parts, a part's loads after the previous part's sums.
template <typename T, int NV, bool Dense>
__device__ inline void matvec_rows(const stacked_rows & m, int64_t n_cols, const uint16_t * __restrict__ x) {
    const int64_t n_rows = m.first[m.n];
    constexpr int part_elements = T::block_elements / T::parts;
    static_assert(matvec_chunk % (warp_lanes * part_elements) == 0 && matvec_chunk % T::block_elements == 0,
                  "a chunk is whole blocks and whole rounds of the warp's parts");
    __shared__ uint16_t xs[NV][matvec_chunk_padded];
    const int64_t blocks_per_row = n_cols / T::block_elements;
    const int lane = static_cast<int>(threadIdx.x), threads = warp_lanes * matvec_rows_per_block;
    const int tid = static_cast<int>(threadIdx.y) * warp_lanes + lane;
    for (int64_t base = int64_t(blockIdx.x) * matvec_rows_per_block; base < n_rows;
         base += int64_t(gridDim.x) * matvec_rows_per_block) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < n_rows; // the block's other warps still stage x and meet at the barriers
        float acc[NV] = {};
        for (int64_t c0 = 0; c0 < n_cols; c0 += matvec_chunk) {
            const int n = static_cast<int>(n_cols - c0 < matvec_chunk ? n_cols - c0 : matvec_chunk);
            __syncthreads(); // every warp is done with the last chunk
            PEBBLE_UNROLL
            for (int v = 0; v < NV; v++) {
                for (int e = tid; e < n; e += threads) xs[v][staged_at<2>(e)] = x[v * n_cols + c0 + e];
            }
            __syncthreads();
            if (!active) continue;
            const uint8_t * w_row = locate(m, row, blocks_per_row * T::block_bytes).w_row;
            if constexpr (Dense) {
                dense_parts<T, NV>(w_row, c0, n, lane, xs, acc);
                continue;
            }
            const int64_t p_end = (c0 + n) / part_elements;
#pragma unroll matvec_unroll
            for (int64_t p = c0 / part_elements + lane; p < p_end; p += warp_lanes) {
                const int64_t block = p / T::parts;
                const int first = static_cast<int>(block * T::block_elements - c0); // the block's element 0 in xs
                auto emit = [&](int i, float weight) {
                    const int at = staged_at<2>(first + i);
                    PEBBLE_UNROLL
                    for (int v = 0; v < NV; v++) acc[v] += weight * half_to_float(xs[v][at]);
                };
                T::decode(w_row + block * T::block_bytes, static_cast<int>(p % T::parts), emit);
            }
        }
        if (active) {
            const stacked_row at = locate(m, row, blocks_per_row * T::block_bytes);
            store_row_sums(acc, lane, at.y, at.rows, at.row);
        }
    }
}

// T::decode's parts at the registers the compiler picks (40 for most: three blocks a multiprocessor).
template <typename T, int NV>
__global__ void __launch_bounds__(warp_lanes * matvec_rows_per_block)
matvec_kernel(const __grid_constant__ stacked_rows m, int64_t n_cols, const uint16_t * __restrict__ x) {
    matvec_rows<T, NV, false>(m, n_cols, x);
}

// dense_parts at two blocks a multiprocessor (64 registers a thread, which its two parts in flight stay
// within; with no bound they took up to 128, and one block).
template <typename T, int NV>
__global__ void __launch_bounds__(warp_lanes * matvec_rows_per_block, 2)
matvec_dense_kernel(const __grid_constant__ stacked_rows m, int64_t n_cols, const uint16_t * __restrict__ x) {
    matvec_rows<T, NV, true>(m, n_cols, x);
}
#endif

// Every quantized type through 8-bit x and integer dot products (dp4a: four byte products and their sum
// in one instruction), where matvec_kernel decodes each weight to float and multiplies it by x's fp16 value
// (I2FP, HADD2, two FFMAs and its shared-memory address for every weight and vector: 0.9 TB/s for Q4_K
// and 1 TB/s for Q6_K on an H200, a quarter of its copy rate). x is quantized as the host library
// quantizes it (cpu/quantize.cc quantize_block: d = max|x| / 127, q = round-half-even(x / d); a block with
// an infinity or NaN d = NaN and q = 0), per 256 elements for the K-quants and IQ4_XS and per 32 for the
// others, while a chunk is staged, with each 16 elements' sum of q; then a lane's part of a block (64
// weights, or a block of 32) is d_x times an exact integer sum over its groups, scaled in float once a group
// (Q4_K, Q5_K: d sc dot - dmin m sum) or once a part (Q6_K: d times sum of sc (dot - 32 sum); Q3_K: d times
// sum of sc (dot - 4 sum); Q2_K: d times sum of sc dot - dmin times sum of m sum; IQ4_XS: d times sum of sc
// dot; Q8_0, IQ4_NL, MXFP4: d dot, the last two's looked-up int8 values in the dot; Q4_0: d (dot - 8 sum);
// Q5_0: d (dot - 16 sum); Q4_1, Q5_1: d dot + m sum). Lanes take parts as matvec_kernel's do; each vector's
// sums are its own, whatever the vectors beside it.
//
// A lane's loop over its parts (q8_lane_parts) and the loads and sums of a part are __host__ __device__:
// with PEBBLING_SIMD=gpu the host library's pebble_matvec runs them for each of 32 lanes (host_q8_matvec
// below), so that CI checks this code for every type without a GPU. The staging of x (stage_q8) and the
// kernel's loop over rows and chunks are the GPU's alone.
#ifndef PEBBLE_HOST_BUILD
constexpr int q8_chunk_bytes(int chunk) { return chunk + 4 * (chunk / 64); } // a word of padding every 64 (banks)

template <int NV, int QB> struct q8_stage { // QB: the elements of one d (256 for 256-element blocks, else 32)
    int8_t q[NV][q8_chunk_bytes(q8_chunk<NV>)]; // x's q, element e of the chunk at staged_at<1>(e)
    float d[NV][q8_chunk<NV> / QB];             // each QB's d
    int32_t sum[NV][q8_chunk<NV> / 16];         // each 16's sum of q
};

// Vector v's elements [c0, c0 + n) of x (fp16, n a multiple of QB) into st, a warp 256 elements, eight a
// lane, QB / 8 lanes a d; every warp of the thread block takes part, and every lane of a warp in its
// shuffles (past n, a whole d's lanes read nothing and store nothing).
template <int NV, int QB>
__device__ void stage_q8(const uint16_t * __restrict__ x, int64_t n_cols, int64_t c0, int n, q8_stage<NV, QB> & st) {
    static_assert(QB == 32 || QB == 256, "the host library's two block sizes");
    const int lane = static_cast<int>(threadIdx.x), blocks = (n + 255) / 256;
    for (int vb = static_cast<int>(threadIdx.y); vb < NV * blocks; vb += static_cast<int>(blockDim.y)) {
        const int v = vb / blocks, b = vb % blocks, e = 256 * b + 8 * lane;
        const bool here = e < n;
        const uint4 raw = here ? *reinterpret_cast<const uint4 *>(x + v * n_cols + c0 + e) : make_uint4(0, 0, 0, 0);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        float f[8], amax = 0.0f;
        bool finite = true;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            f[k] = half_to_float(static_cast<uint16_t>(words[k / 2] >> (16 * (k % 2))));
            finite = finite && isfinite(f[k]);
            amax = fmaxf(amax, fabsf(f[k]));
        }
        int all_finite = finite;
        PEBBLE_UNROLL
        for (int o = 1; o < QB / 8; o <<= 1) { // over the lanes of one d
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            all_finite &= __shfl_xor_sync(0xffffffffu, all_finite, o);
        }
        finite = all_finite != 0;
        const float d = finite ? amax / 127.0f : NAN, id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        uint32_t packed[2] = {0, 0};
        int sum = 0;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            const int q = finite ? __float2int_rn(f[k] * id) : 0;
            sum += q;
            packed[k / 4] |= (static_cast<uint32_t>(q) & 0xffu) << (8 * (k % 4));
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1); // two lanes a 16-element group
        if (!here) continue;
        int32_t * to = reinterpret_cast<int32_t *>(&st.q[v][staged_at<1>(e)]); // 8 bytes within a padding group
        to[0] = static_cast<int32_t>(packed[0]);
        to[1] = static_cast<int32_t>(packed[1]);
        if (lane % 2 == 0) st.sum[v][e / 16] = sum;
        if (lane % (QB / 8) == 0) st.d[v][e / QB] = d;
    }
}
#endif

#ifndef PEBBLE_HOST_BUILD
// Two blocks a multiprocessor (64 registers a thread): without the bound, a lane's two parts in registers
// took 72 to 127 and one block, which halved the warps and undid the loads' gain; with it none spills.
template <typename T, int NV, int WR>
__global__ void __launch_bounds__(warp_lanes * matvec_rows_per_block, 2)
matvec_q8_kernel(const __grid_constant__ stacked_rows m, int64_t n_cols, const uint16_t * __restrict__ x, bool whole) {
    const int64_t n_rows = m.first[m.n];
    constexpr bool k_quant = T::block_elements == 256;
    constexpr int part_elements = T::block_elements / T::parts; // 64 for 256-element blocks, else a block of 32
    static_assert(part_elements == (k_quant ? 64 : 32), "the parts this kernel reads");
    __shared__ __align__(16) q8_stage<NV, k_quant ? 256 : 32> st;
    const int64_t blocks_per_row = n_cols / T::block_elements;
    const int lane = static_cast<int>(threadIdx.x);
    // whole (a row that fits one chunk, unless PEBBLING_CUDA_PERSIST=0): x staged once, then every row the
    // block takes read without a barrier (the launcher gives such a product only the blocks the GPU holds
    // at once, so each stages once).
    constexpr int chunk = q8_chunk<NV>;
    if (whole) {
        stage_q8<NV>(x, n_cols, 0, static_cast<int>(n_cols), st);
        __syncthreads();
    }
    // A warp takes WR rows at once, row r of them warps_per_block apart, so that the loads of their parts
    // are in flight together (see warp_rows).
    constexpr int64_t block_rows = int64_t(matvec_rows_per_block) * WR;
    for (int64_t base = int64_t(blockIdx.x) * block_rows; base < n_rows; base += int64_t(gridDim.x) * block_rows) {
        int64_t row[WR];
        bool active[WR]; // the same for the warp's lanes; the block's other warps still meet at the barriers
        float acc[WR][NV] = {};
        PEBBLE_UNROLL
        for (int r = 0; r < WR; r++) {
            row[r] = base + int64_t(r) * matvec_rows_per_block + threadIdx.y;
            active[r] = row[r] < n_rows;
        }
        for (int64_t c0 = 0; c0 < n_cols; c0 += chunk) {
            const int n = static_cast<int>(n_cols - c0 < chunk ? n_cols - c0 : chunk);
            if (!whole) {
                __syncthreads(); // every warp is done with the last chunk
                stage_q8<NV>(x, n_cols, c0, n, st);
                __syncthreads();
            }
            if (!active[0]) continue; // row 0 is the warp's first: none of its rows are
            const uint8_t * w_row[WR];
            PEBBLE_UNROLL
            for (int r = 0; r < WR; r++) {
                w_row[r] = active[r] ? locate(m, row[r], blocks_per_row * T::block_bytes).w_row : nullptr;
            }
            q8_lane_parts<T, NV, WR>(w_row, active, c0, n, lane, st, acc);
        }
        PEBBLE_UNROLL
        for (int r = 0; r < WR; r++) {
            if (!active[r]) continue;
            const stacked_row at = locate(m, row[r], blocks_per_row * T::block_bytes);
            store_row_sums(acc[r], lane, at.y, at.rows, at.row);
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------------
// launchers


// f(std::integral_constant<int, n_vec>{}) for n_vec in 1..8: the number of vectors is a template argument,
// so that each lane's sums stay in registers.
template <typename F> pebble_status with_vectors(int32_t n_vec, F && f) {
    static_assert(PEBBLE_MATVEC_MAX_VEC == 8, "one case per vector count");
    switch (n_vec) {
        case 1: return f(std::integral_constant<int, 1>{});
        case 2: return f(std::integral_constant<int, 2>{});
        case 3: return f(std::integral_constant<int, 3>{});
        case 4: return f(std::integral_constant<int, 4>{});
        case 5: return f(std::integral_constant<int, 5>{});
        case 6: return f(std::integral_constant<int, 6>{});
        case 7: return f(std::integral_constant<int, 7>{});
        case 8: return f(std::integral_constant<int, 8>{});
    }
    return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_matvec: n_vec %d is outside 1..%d", n_vec, PEBBLE_MATVEC_MAX_VEC);
}

#ifndef PEBBLE_HOST_BUILD
// The stack's matrices' addresses or'ed together: their low bits say whether every one is 16-byte aligned.
uintptr_t stack_addresses(const stacked_rows & m) {
    uintptr_t bits = 0;
    for (int32_t p = 0; p < m.n; p++) bits |= reinterpret_cast<uintptr_t>(m.w[p]);
    return bits;
}

template <typename T, int NV>
pebble_status launch_stacked_n(const stacked_rows & m, int64_t n_cols, const uint16_t * x, cudaStream_t stream) {
    const int64_t n_rows = m.first[m.n];
    const int64_t grid = std::min(max_grid, (n_rows + matvec_rows_per_block - 1) / matvec_rows_per_block);
    const dim3 block(warp_lanes, matvec_rows_per_block);
    if constexpr (T::block_elements > 1) { // every quantized type; 16-byte loads of x (and Q4_K's and Q5_K's weights)
        const uintptr_t aligned = reinterpret_cast<uintptr_t>(x) | (k45<T> ? stack_addresses(m) : 0);
        if ((aligned & 15) == 0 && switches().integer_matvec) {
            static const int64_t held = resident_blocks(matvec_q8_kernel<T, NV, 1>, warp_lanes * matvec_rows_per_block);
            const bool whole = switches().persist && n_cols <= q8_chunk<NV>;
            if constexpr (warp_rows<NV> > 1) { // only where the row groups outnumber the blocks the GPU holds:
                if (grid > held) {             // fewer blocks would leave multiprocessors idle
                    constexpr int64_t rows_a_block = int64_t(matvec_rows_per_block) * warp_rows<NV>;
                    static const int64_t held_wide =
                        resident_blocks(matvec_q8_kernel<T, NV, warp_rows<NV>>, warp_lanes * matvec_rows_per_block);
                    const int64_t wide_grid = std::min(max_grid, (n_rows + rows_a_block - 1) / rows_a_block);
                    const int64_t blocks = whole ? std::min(wide_grid, held_wide) : wide_grid;
                    matvec_q8_kernel<T, NV, warp_rows<NV>>
                        <<<static_cast<unsigned>(blocks), block, 0, stream>>>(m, n_cols, x, whole);
                    return check_launch("pebble_matvec", T::id);
                }
            }
            const int64_t blocks = whole ? std::min(grid, held) : grid;
            matvec_q8_kernel<T, NV, 1><<<static_cast<unsigned>(blocks), block, 0, stream>>>(m, n_cols, x, whole);
            return check_launch("pebble_matvec", T::id);
        }
    }
    if constexpr (T::id == type_f16::id || T::id == type_bf16::id || T::id == type_f32::id) {
        if ((stack_addresses(m) & 15) == 0 && n_cols % dense_part == 0 && switches().dense) {
            matvec_dense_kernel<T, NV><<<static_cast<unsigned>(grid), block, 0, stream>>>(m, n_cols, x);
            return check_launch("pebble_matvec", T::id);
        }
    }
    matvec_kernel<T, NV><<<static_cast<unsigned>(grid), block, 0, stream>>>(m, n_cols, x);
    return check_launch("pebble_matvec", T::id);
}

template <typename T>
pebble_status launch_stacked(const stacked_rows & m, int64_t n_cols, const uint16_t * x, int32_t n_vec,
                             cudaStream_t stream) {
    return with_vectors(n_vec, [&](auto nv) { return launch_stacked_n<T, decltype(nv)::value>(m, n_cols, x, stream); });
}

stacked_rows one_matrix(const uint8_t * w, int64_t n_rows, float * y) {
    stacked_rows m = {};
    m.w[0] = w;
    m.y[0] = y;
    m.first[1] = n_rows;
    m.n = 1;
    return m;
}
#endif

#ifdef PEBBLE_HOST_BUILD
// The staging of a row of x for host_q8_matvec, indexed as the GPU's q8_stage is (q at staged_at<1>); `from`
// gives the view of the stretch from element c0 on (a multiple of 256), as a chunk's staging is indexed.
template <int NV> struct host_q8_stage {
    const int8_t *  q[NV];
    const float *   d[NV];
    const int32_t * sum[NV];

    host_q8_stage from(int64_t c0, int qb) const {
        host_q8_stage view = *this;
        for (int v = 0; v < NV; v++) {
            view.q[v] += staged_at<1>(static_cast<int>(c0));
            view.d[v] += c0 / qb;
            view.sum[v] += c0 / 16;
        }
        return view;
    }
};

// The 32 lanes' sums of a row added as __shfl_xor_sync's butterfly adds them (warp_sum), into y's row r.
template <int NV> void host_warp_sums(float (&lanes)[32][NV], float * y, int64_t n_rows, int64_t r) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        float next[32][NV];
        for (int l = 0; l < 32; l++) {
            for (int v = 0; v < NV; v++) next[l][v] = lanes[l][v] + lanes[l ^ offset][v];
        }
        memcpy(lanes, next, sizeof lanes);
    }
    for (int v = 0; v < NV; v++) y[v * n_rows + r] = lanes[0][v];
}

// PEBBLING_SIMD=gpu: y = W x as the GPU's integer kernel computes it (one row a warp: warp_rows 1), a row
// at a time (rows among the pool's threads): x quantized per QB elements (pebble_cpu's quantization, which
// the GPU's stage_q8 repeats) with each 16's sum of q, then for each of the kernel's chunks of x each of 32
// lanes in turn through the kernel's own q8_lane_parts, and the lanes' sums added as the GPU's shuffles
// add them. Only the fused multiply-adds the GPU's compiler makes differ from the GPU's sums.
template <typename T, int NV>
pebble_status host_q8_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, float * y) {
    constexpr int QB = T::block_elements == 256 ? 256 : 32;
    if (n_cols > (int64_t(1) << 30)) { // staged_at's int offsets, as the GPU's shared memory's
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_matvec: %s: n_cols %" PRId64 " is past the 2^30 columns "
                    "PEBBLING_SIMD=gpu stages; unset it for the host's kernels", type_name(T::id), n_cols);
    }
    const int64_t staged = staged_at<1>(static_cast<int>(n_cols)) + 4, blocks = n_cols / QB;
    std::unique_ptr<int32_t[]> q_words(new (std::nothrow) int32_t[NV * staged / 4 + 1]);
    std::unique_ptr<float[]> d(new (std::nothrow) float[NV * blocks]);
    std::unique_ptr<int32_t[]> sums(new (std::nothrow) int32_t[NV * (n_cols / 16)]);
    if (!q_words || !d || !sums) {
        return fail(PEBBLE_ERR_HOST_OOM, "pebble_matvec: %s: no host memory to stage x (%" PRId64 " columns)",
                    type_name(T::id), n_cols);
    }
    int8_t * q = reinterpret_cast<int8_t *>(q_words.get());
    host_q8_stage<NV> st;
    for (int v = 0; v < NV; v++) {
        int8_t * qv = q + v * staged;
        for (int64_t b = 0; b < blocks; b++) {
            int8_t block[256];
            pebble_cpu::quantize(x + v * n_cols + b * QB, QB, d[v * blocks + b], block);
            for (int i = 0; i < QB; i++) qv[staged_at<1>(static_cast<int>(b * QB + i))] = block[i];
            for (int g = 0; g < QB / 16; g++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += block[16 * g + i];
                sums[v * (n_cols / 16) + b * QB / 16 + g] = s;
            }
        }
        st.q[v] = qv;
        st.d[v] = d.get() + v * blocks;
        st.sum[v] = sums.get() + v * (n_cols / 16);
    }
    const int64_t row_bytes = n_cols / T::block_elements * T::block_bytes;
    constexpr int chunk = q8_chunk<NV>;
    host_parallel(n_rows, n_rows * n_cols * NV, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
            float lanes[32][NV] = {};
            const uint8_t * const w_row[1] = {w + r * row_bytes};
            const bool active[1] = {true};
            for (int64_t c0 = 0; c0 < n_cols; c0 += chunk) {
                const int n = static_cast<int>(std::min<int64_t>(chunk, n_cols - c0));
                const host_q8_stage<NV> view = st.from(c0, QB);
                for (int lane = 0; lane < 32; lane++) {
                    float acc[1][NV];
                    memcpy(acc[0], lanes[lane], sizeof acc);
                    q8_lane_parts<T, NV, 1, 32>(w_row, active, c0, n, lane, view, acc);
                    memcpy(lanes[lane], acc[0], sizeof acc);
                }
            }
            host_warp_sums(lanes, y, n_rows, r);
        }
    });
    return PEBBLE_OK;
}

// PEBBLING_SIMD=gpu for F16, BF16 and F32 rows of whole 8-element parts: y = W x as the GPU's dense kernel
// computes it, x staged in fp16 a chunk of matvec_chunk at a time as the kernel stages it, each of 32 lanes
// in turn through the kernel's own dense_parts, and the lanes' sums added as the GPU's shuffles add them.
template <typename T, int NV>
pebble_status host_dense_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, float * y) {
    const int64_t row_bytes = n_cols * T::block_bytes;
    host_parallel(n_rows, n_rows * n_cols * NV, [&](int64_t begin, int64_t end) {
        uint16_t xs[NV][matvec_chunk_padded]; // 34 KB at 8 vectors
        for (int64_t r = begin; r < end; r++) {
            float lanes[32][NV] = {};
            for (int64_t c0 = 0; c0 < n_cols; c0 += matvec_chunk) {
                const int n = static_cast<int>(std::min<int64_t>(matvec_chunk, n_cols - c0));
                for (int v = 0; v < NV; v++) {
                    for (int e = 0; e < n; e++) xs[v][staged_at<2>(e)] = x[v * n_cols + c0 + e];
                }
                for (int lane = 0; lane < 32; lane++) {
                    dense_parts<T, NV, 32>(w + r * row_bytes, c0, n, lane, xs, lanes[lane]);
                }
            }
            host_warp_sums(lanes, y, n_rows, r);
        }
    });
    return PEBBLE_OK;
}

// pebble_matvec, pebble_matmul and pebble_matmul_f32 with PEBBLING_SIMD=gpu, as the cuda library runs them:
// float32 x rounded to fp16 first, then host_q8_matvec (the quantized types) or host_dense_matvec (F16,
// BF16, F32 in rows of whole 8-element parts) over groups of up to 8 vectors.
template <typename T>
pebble_status host_gpu_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const void * x, bool x_f32,
                              int64_t n_vec, float * y, const char * fn) {
    TRY(pebble_cpu::check_threads(fn));
    const uint16_t * x_f16 = static_cast<const uint16_t *>(x);
    std::unique_ptr<uint16_t[]> half;
    if (x_f32) {
        half.reset(new (std::nothrow) uint16_t[n_vec * n_cols]);
        if (!half) return fail(PEBBLE_ERR_HOST_OOM, "%s: %s: no host memory for x in fp16", fn, type_name(T::id));
        const float * xf = static_cast<const float *>(x);
        for (int64_t i = 0; i < n_vec * n_cols; i++) half[i] = half_from_float(xf[i]); // to_half_kernel's
        x_f16 = half.get();
    }
    for (int64_t v = 0; v < n_vec; v += PEBBLE_MATVEC_MAX_VEC) {
        const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
        TRY(with_vectors(group, [&](auto nv) {
            constexpr int NV = decltype(nv)::value;
            if constexpr (T::block_elements > 1) {
                return host_q8_matvec<T, NV>(w, n_rows, n_cols, x_f16 + v * n_cols, y + v * n_rows);
            } else {
                return host_dense_matvec<T, NV>(w, n_rows, n_cols, x_f16 + v * n_cols, y + v * n_rows);
            }
        }));
    }
    return PEBBLE_OK;
}
#endif

template <typename T, int NV>
pebble_status launch_matvec_n(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, float * y,
                              cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream; // the host's kernels (cpu/matmul.cc): x quantized once, integer SIMD dot products
    return pebble_cpu::matmul(T::id, w, n_rows, n_cols, x, false, NV, y, "pebble_matvec");
#else
    return launch_stacked_n<T, NV>(one_matrix(w, n_rows, y), n_cols, x, stream);
#endif
}

// One matrix times n_vec (1..8) vectors.
template <typename T>
pebble_status launch_matvec(const uint8_t * w, int64_t n_rows, int64_t n_cols, const uint16_t * x, int32_t n_vec,
                            float * y, cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    return with_vectors(n_vec, [&](auto nv) {
        return launch_matvec_n<T, decltype(nv)::value>(w, n_rows, n_cols, x, y, stream);
    });
#else
    return launch_stacked<T>(one_matrix(w, n_rows, y), n_cols, x, n_vec, stream);
#endif
}

} // namespace

// ---------------------------------------------------------------------------------------------------
// for the decode step (cuda/ops.cuh)

namespace pebble_internal {

pebble_status matvec_one(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const uint16_t * x,
                         float * y, cudaStream_t stream) {
    return with_type(ggml_type, "pebble_matvec", [&](auto t) {
        using T = decltype(t);
        return launch_matvec_n<T, 1>(static_cast<const uint8_t *>(w), n_rows, n_cols, x, y, stream);
    });
}

pebble_status matvec_many(int32_t ggml_type, const void * w, int64_t n_rows, int64_t n_cols, const void * x,
                          int64_t n_vec, float * y, cudaStream_t stream) {
    return with_type(ggml_type, "pebble_decoder_step", [&](auto t) {
        using T = decltype(t);
#ifdef PEBBLE_HOST_BUILD
        (void)stream;
        return pebble_cpu::matmul(T::id, static_cast<const uint8_t *>(w), n_rows, n_cols, x, true, n_vec, y,
                                  "pebble_decoder_step", true);
#else
        const uint16_t * x16 = static_cast<const uint16_t *>(x);
        for (int64_t v = 0; v < n_vec; v += PEBBLE_MATVEC_MAX_VEC) {
            const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
            TRY(launch_matvec<T>(static_cast<const uint8_t *>(w), n_rows, n_cols, x16 + v * n_cols, group,
                                 y + v * n_rows, stream));
        }
        return PEBBLE_OK;
#endif
    });
}

pebble_status matvec_parts(const matvec_part * parts, int n_parts, int64_t n_cols, const void * x, int64_t n_vec,
                           cudaStream_t stream) {
#ifdef PEBBLE_HOST_BUILD
    (void)stream;
    pebble_cpu::matmul_part cpu[pebble_cpu::max_matmul_parts];
    for (int p = 0; p < std::min(n_parts, pebble_cpu::max_matmul_parts); p++) { // matmul_parts refuses other counts
        TRY(with_type(parts[p].ggml_type, "pebble_decoder_step", [](auto) { return PEBBLE_OK; }));
        cpu[p] = {parts[p].ggml_type, static_cast<const uint8_t *>(parts[p].w), parts[p].n_rows, parts[p].y};
    }
    return pebble_cpu::matmul_parts(cpu, n_parts, n_cols, x, true, n_vec, "pebble_decoder_step", true);
#else
    const uint16_t * x16 = static_cast<const uint16_t *>(x);
    for (int p = 0; p < n_parts;) {
        int end = p + 1; // the parts of p's type that follow it: one stack
        // (and of its alignment: a part whose weights are not 16-byte aligned would take the whole stack
        // to the float kernel, which multiplies x as it is, where alone the others take the integer one)
        const int most = switches().stack ? max_stacked : 1;
        auto aligned = [&](int k) { return (reinterpret_cast<uintptr_t>(parts[k].w) & 15) == 0; };
        while (end < n_parts && end - p < most && parts[end].ggml_type == parts[p].ggml_type &&
               aligned(end) == aligned(p)) end++;
        TRY(with_type(parts[p].ggml_type, "pebble_decoder_step", [&](auto t) {
            using T = decltype(t);
            for (int64_t v = 0; v < n_vec; v += PEBBLE_MATVEC_MAX_VEC) {
                stacked_rows m = {};
                for (int k = p; k < end; k++, m.n++) {
                    m.w[m.n] = static_cast<const uint8_t *>(parts[k].w);
                    m.y[m.n] = parts[k].y + v * parts[k].n_rows;
                    m.first[m.n + 1] = m.first[m.n] + parts[k].n_rows;
                }
                const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
                TRY(launch_stacked<T>(m, n_cols, x16 + v * n_cols, group, stream));
            }
            return PEBBLE_OK;
        }));
        p = end;
    }
    return PEBBLE_OK;
#endif
}

} // namespace pebble_internal

// ---------------------------------------------------------------------------------------------------
// the products of the ABI

namespace {

#ifndef PEBBLE_HOST_BUILD
// fp16 bits of float32 x, rounded to nearest even (pebble_matmul_f32 on the GPU)
__global__ void to_half_kernel(const float * __restrict__ x, uint16_t * __restrict__ out, int64_t n) {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        out[i] = half_from_float(x[i]);
    }
}
#endif

// pebble_matvec's, pebble_matmul's and pebble_matmul_f32's checks and work: n_vec up to max_vec; x fp16,
// or float32 (x_f32) rounded to fp16 before it is multiplied.
pebble_status matvec_call(const char * fn, int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                          int64_t n_cols, const void * x, bool x_f32, int64_t n_vec, int64_t max_vec, float * y,
                          void * stream) {
    const char * x_name = x_f32 ? "x" : "x_f16";
    return with_type(ggml_type, fn, [&](auto t) {
        using T = decltype(t);
        const char * name = type_name(T::id);
        // The counts first: with nothing to compute, a caller's empty buffers may well be NULL.
        if (n_vec < 1 || n_vec > max_vec) {
            if (max_vec == INT64_MAX) {
                return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: n_vec must be at least 1, got %" PRId64, fn, name,
                            n_vec);
            }
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: n_vec %" PRId64 " is outside 1..%" PRId64, fn, name,
                        n_vec, max_vec);
        }
        if (n_rows < 1 || n_cols < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: n_rows and n_cols must be at least 1, "
                        "got %" PRId64 " x %" PRId64, fn, name, n_rows, n_cols);
        }
        if (!w || !x || !y) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s: w, %s and y must not be NULL (w %p, "
                        "%s %p, y %p)", fn, name, x_name, w, x_name, x, static_cast<void *>(y));
        }
        if (n_cols % T::block_elements != 0) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: n_cols %" PRId64 " is not a multiple of the "
                        "%d-element block", fn, name, n_cols, T::block_elements);
        }
        // Every index the kernel forms (row bytes, x and y offsets) must fit in int64.
        const int64_t blocks_per_row = n_cols / T::block_elements;
        if (blocks_per_row > INT64_MAX / T::block_bytes || n_rows > INT64_MAX / (blocks_per_row * T::block_bytes) ||
            n_cols > INT64_MAX / n_vec || n_rows > INT64_MAX / n_vec) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %" PRId64 " x %" PRId64 " weights (or %" PRId64
                        " vectors of them) take more than 2^63 bytes", fn, name, n_rows, n_cols, n_vec);
        }
        const int64_t row_bytes = blocks_per_row * T::block_bytes;
        const uint64_t want = static_cast<uint64_t>(n_rows) * static_cast<uint64_t>(row_bytes);
        if (w_bytes != want) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %s: %" PRId64 " rows of %" PRId64 " elements are %"
                        PRId64 " x %" PRId64 " = %" PRIu64 " bytes, but w_bytes is %" PRIu64, fn, name, n_rows,
                        n_cols, n_rows, row_bytes, want, w_bytes);
        }
#ifdef PEBBLE_HOST_BUILD
        (void)stream;
        (void)x_name;
        if (pebble_cpu::gpu_arithmetic() && (T::block_elements > 1 || n_cols % dense_part == 0)) {
            return host_gpu_matvec<T>(static_cast<const uint8_t *>(w), n_rows, n_cols, x, x_f32, n_vec, y, fn);
        }
        return pebble_cpu::matmul(T::id, static_cast<const uint8_t *>(w), n_rows, n_cols, x, x_f32, n_vec, y, fn);
#else
        TRY(check_reachable(w, "w", fn, T::id));
        TRY(check_reachable(x, x_name, fn, T::id));
        TRY(check_reachable(y, "y", fn, T::id));
        const cudaStream_t s = static_cast<cudaStream_t>(stream);
        const uint16_t * x_f16 = static_cast<const uint16_t *>(x);
        void * half = nullptr;
        if (x_f32) { // rounded to fp16 on the stream, into memory that lives as long as the call's kernels
            const int64_t n = n_vec * n_cols;
            if (cudaMallocAsync(&half, static_cast<size_t>(n) * 2, s) != cudaSuccess) {
                cudaGetLastError();
                return fail(PEBBLE_ERR_DEVICE_OOM, "%s: %s: no device memory for %" PRId64 " fp16 elements of x", fn,
                            name, n);
            }
            to_half_kernel<<<static_cast<unsigned>(std::min<int64_t>(max_grid, (n + 255) / 256)), 256, 0, s>>>(
                static_cast<const float *>(x), static_cast<uint16_t *>(half), n);
            x_f16 = static_cast<const uint16_t *>(half);
        }
        pebble_status status = PEBBLE_OK;
        for (int64_t v = 0; v < n_vec && status == PEBBLE_OK; v += PEBBLE_MATVEC_MAX_VEC) {
            const int32_t group = static_cast<int32_t>(std::min<int64_t>(PEBBLE_MATVEC_MAX_VEC, n_vec - v));
            status = launch_matvec<T>(static_cast<const uint8_t *>(w), n_rows, n_cols, x_f16 + v * n_cols, group,
                                      y + v * n_rows, s);
        }
        if (half) cudaFreeAsync(half, s);
        return status;
#endif
    });
}

} // namespace

extern "C" pebble_status pebble_matvec(int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                                       int64_t n_cols, const uint16_t * x_f16, int32_t n_vec, float * y,
                                       void * stream) {
    return matvec_call("pebble_matvec", ggml_type, w, w_bytes, n_rows, n_cols, x_f16, false, n_vec,
                       PEBBLE_MATVEC_MAX_VEC, y, stream);
}

extern "C" pebble_status pebble_matmul(int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                                       int64_t n_cols, const uint16_t * x_f16, int64_t n_vec, float * y,
                                       void * stream) {
    return matvec_call("pebble_matmul", ggml_type, w, w_bytes, n_rows, n_cols, x_f16, false, n_vec, INT64_MAX, y,
                       stream);
}

extern "C" pebble_status pebble_matmul_f32(int32_t ggml_type, const void * w, uint64_t w_bytes, int64_t n_rows,
                                           int64_t n_cols, const float * x, int64_t n_vec, float * y, void * stream) {
    return matvec_call("pebble_matmul_f32", ggml_type, w, w_bytes, n_rows, n_cols, x, true, n_vec, INT64_MAX, y,
                       stream);
}

// cuda/vecdot.cuh: the matrix-vector product's inner loops, type by type, for cuda/matvec.cu: a lane's
// 8-element parts of a row of F16, BF16 or F32 weights times x staged in fp16 (dense_parts), and a lane's
// parts of a row of Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL or MXFP4 weights (and Q2_K, Q3_K,
// IQ4_XS: cuda/vecdot_low.cuh) times x quantized to 8 bits: a part's bytes loaded into registers, then its
// exact integer dot products with x's quants, scaled in float once a group (q8_lane_parts over load_part and
// sum_part); with the kernel's shape they are sized by (rows a thread block, x staged a chunk at a time). All
// __host__ __device__: the GPU's kernels run them, and the host library with PEBBLING_SIMD=gpu for each of 32
// lanes in turn. Not part of the ABI.
#pragma once

#include "cuda/quants.cuh"
#include "cuda/vecdot_low.cuh"

#include <cstdint>

namespace pebble_internal {

// ---------------------------------------------------------------------------------------------------
// the kernel's shape

#ifndef PEBBLE_MATVEC_ROWS // a build may set these five to compare (benchmarks/bench_matvec.py --libs)
#    define PEBBLE_MATVEC_ROWS 16
#endif
#ifndef PEBBLE_Q8_CHUNK
#    define PEBBLE_Q8_CHUNK 4096
#endif
#ifndef PEBBLE_Q8_CHUNK_FEW // the same at one or two vectors
#    define PEBBLE_Q8_CHUNK_FEW 16384
#endif
#ifndef PEBBLE_MATVEC_UNROLL // a lane's parts of a chunk unrolled by this, so their loads can go out together
#    define PEBBLE_MATVEC_UNROLL 4
#endif
#ifndef PEBBLE_MATVEC_WARP_ROWS // rows a warp of the integer kernel takes at once at 1-2 vectors (see warp_rows)
#    define PEBBLE_MATVEC_WARP_ROWS 1
#endif
#ifndef PEBBLE_MATVEC_LOADS // parts a lane of the integer kernel loads before it sums the first (see part_loads):
#    define PEBBLE_MATVEC_LOADS 1 // H200, 11-27: 1 led 2 (also without PERSIST) and 4 at each kernel-bound shape:
#endif                           // the Q6_K output 259 us against 312 (327) and 418, 4096 x 14336 43.5 against 59.9 (49.6), 70.1
constexpr int matvec_unroll = PEBBLE_MATVEC_UNROLL;
constexpr int matvec_rows_per_block = PEBBLE_MATVEC_ROWS; // warps per thread block: rows sharing one staging of x
constexpr int matvec_warp_rows = PEBBLE_MATVEC_WARP_ROWS;
constexpr int matvec_chunk = 2048;        // x elements staged per vector at a time
constexpr int matvec_chunk_padded = matvec_chunk + 2 * (matvec_chunk / 64);
// x elements the integer kernel stages per vector at a time: at one or two vectors a 14336-column row
// (Llama-3-8B's ffn_down) fits one chunk within the 48 KB a block's static shared memory may take; more take 4096.
template <int NV> constexpr int q8_chunk = NV <= 2 ? PEBBLE_Q8_CHUNK_FEW : PEBBLE_Q8_CHUNK;
// Rows a warp of the integer kernel takes at once: matvec_warp_rows at one or two vectors, where a row's
// loads are few, for a matrix of more row groups than the GPU holds at once (fewer blocks would leave
// multiprocessors idle); one at more vectors, whose sums take the registers (two rows spilled from 4 vectors up).
template <int NV> constexpr int warp_rows = NV <= 2 ? matvec_warp_rows : 1;
// Parts a lane loads before it sums the first: PEBBLE_MATVEC_LOADS over the warp's rows at once (at least
// one), so that the registers they take stay near one row's at two (a part is 12 words of Q4_K, 20 of
// Q5_K, 21 of Q6_K).
template <int WR> constexpr int part_loads = PEBBLE_MATVEC_LOADS / WR > 1 ? PEBBLE_MATVEC_LOADS / WR : 1;

// ---------------------------------------------------------------------------------------------------
// F16, BF16 and F32 weights times fp16 x

// F16, BF16 and F32 weights, eight elements a lane's part (16 bytes of F16 or BF16, 32 of F32) in 16-byte
// loads, two parts loaded before the first is summed, where matvec_kernel's parts are single elements (a
// 2-byte load each: about 1 TB/s on an H200, a fifth of its copy rate). x is staged as matvec_kernel stages
// it; a part's products are summed into each vector's sum in element order. Rows of a multiple of 8
// elements, every matrix 16-byte aligned (PEBBLING_CUDA_DENSE=0: an element a part).
constexpr int dense_part = 8; // elements of a lane's part

template <typename T> __host__ __device__ inline float dense_value(const uint4 (&w)[T::block_bytes / 2], int i) {
    const uint32_t word = reinterpret_cast<const uint32_t *>(w)[T::block_bytes == 4 ? i : i / 2];
    if constexpr (T::id == type_f32::id) {
        return float_from_bits(word);
    } else {
        const uint32_t bits = (word >> (16 * (i % 2))) & 0xffffu;
        return T::id == type_f16::id ? half_to_float(static_cast<uint16_t>(bits)) : float_from_bits(bits << 16);
    }
}

// Lane `lane` (of Lanes)'s 8-element parts of the chunk [c0, c0 + n) of row w_row (F16, BF16 or F32), U at
// a time: their loads first, then each part's products, in element order, into acc. (On the host, for
// PEBBLING_SIMD=gpu, each of 32 lanes in turn: host_dense_matvec.)
template <typename T, int NV, int Lanes = warp_lanes>
__host__ __device__ inline void dense_parts(const uint8_t * __restrict__ w_row, int64_t c0, int n, int lane,
                                            const uint16_t (&xs)[NV][matvec_chunk_padded], float (&acc)[NV]) {
    constexpr int words = T::block_bytes / 2, U = 2; // 16-byte loads a part (1 or 2), parts loaded at once
    const uint8_t * w = w_row + c0 / dense_part * words * 16;
    const int parts = n / dense_part;
    for (int p0 = lane; p0 < parts; p0 += U * Lanes) {
        uint4 loaded[U][words];
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * Lanes;
            if (p >= parts) break;
            PEBBLE_UNROLL
            for (int k = 0; k < words; k++) loaded[u][k] = load_16(w + (int64_t(p) * words + k) * 16);
        }
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int p = p0 + u * Lanes;
            if (p >= parts) break;
            PEBBLE_UNROLL
            for (int i = 0; i < dense_part; i++) {
                const float weight = dense_value<T>(loaded[u], i);
                const int at = staged_at<2>(p * dense_part + i);
                PEBBLE_UNROLL
                for (int v = 0; v < NV; v++) acc[v] += weight * half_to_float(xs[v][at]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// the quantized types times 8-bit x

// The scale bytes of a Q4_K or Q5_K block (its bytes 4..15) as loaded with its first 16 (head), read from
// the registers (a byte array indexed by the run-time sub-block would be local memory).
struct scale_bytes {
    uint4 head;
    __host__ __device__ uint32_t operator[](int i) const {
        const uint32_t word = i < 4 ? head.y : i < 8 ? head.z : head.w;
        return (word >> (8 * (i & 3))) & 0xffu;
    }
};

// A lane's part of a block, loaded: the weight bytes it reads, in registers, so that the loads of a lane's
// next parts go out before the first is used (as one loop, each part's loads waited for the part before it
// to be summed: one part's bytes in flight a lane, under half the copy rate's).
template <typename T> struct k_bytes { uint4 head, lo, hi; };                  // Q4_K: d, dmin, scales; 32 nibble bytes
template <> struct k_bytes<type_q5_k> { uint4 head, lo, hi, qh_lo, qh_hi; }; // and Q5_K's 32 bytes of fifth bits
struct q6_k_bytes { uint32_t ql[8], qh[8]; int sc[4]; uint16_t d; };
template <int N> struct block32_bytes { uint32_t qs[N / 4], qh; uint16_t d, m; }; // qh, m where the type has them;
                                                                                  // d MXFP4's E8M0 byte

// Part `part` of Q4_K or Q5_K block bb: sub-blocks 2 part (the low nibbles of 32 bytes) and 2 part + 1
// (their high nibbles), and for Q5_K the 32 bytes of fifth bits, in 16-byte loads (the blocks are 144 and
// 176 bytes, so a 16-byte aligned matrix has every block aligned).
template <typename T>
__host__ __device__ inline k_bytes<T> k_load(const uint8_t * __restrict__ bb, int part) {
    if constexpr (T::id == type_q5_k::id) {
        return {load_16(bb), load_16(bb + 48 + 32 * part), load_16(bb + 64 + 32 * part), load_16(bb + 16),
                load_16(bb + 32)};
    } else {
        return {load_16(bb), load_16(bb + 16 + 32 * part), load_16(bb + 32 + 32 * part)};
    }
}

// That part's products with x, whose element 0 is element `first` of the staging st.
template <typename T, int NV, typename Stage>
__host__ __device__ void k_part(const k_bytes<T> & w, int part, int first, const Stage & st, float (&acc)[NV]) {
    const uint4 head = w.head, lo = w.lo, hi = w.hi;
    const float d = half_to_float(static_cast<uint16_t>(head.x)), dmin = half_to_float(static_cast<uint16_t>(head.x >> 16));
    const scale_bytes scales{head};
    int sc_a, m_a, sc_b, m_b;
    type_q4_k::scale_min(scales, 2 * part, sc_a, m_a);
    type_q4_k::scale_min(scales, 2 * part + 1, sc_b, m_b);
    const float d_a = d * static_cast<float>(sc_a), d_b = d * static_cast<float>(sc_b);
    const float min_a = dmin * static_cast<float>(m_a), min_b = dmin * static_cast<float>(m_b);
    const uint32_t qs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint32_t q_a[8], q_b[8]; // sub-block A's and B's q, four a word: a nibble, and Q5_K's fifth bit above it
    PEBBLE_UNROLL
    for (int k = 0; k < 8; k++) {
        q_a[k] = qs[k] & 0x0f0f0f0fu;
        q_b[k] = (qs[k] >> 4) & 0x0f0f0f0fu;
    }
    if constexpr (T::id == type_q5_k::id) { // element l's fifth bits are bits 2 part, 2 part + 1 of byte l
        const uint32_t qh[8] = {w.qh_lo.x, w.qh_lo.y, w.qh_lo.z, w.qh_lo.w, w.qh_hi.x, w.qh_hi.y, w.qh_hi.z, w.qh_hi.w};
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            q_a[k] |= ((qh[k] >> (2 * part)) & 0x01010101u) << 4;
            q_b[k] |= ((qh[k] >> (2 * part + 1)) & 0x01010101u) << 4;
        }
    }
    const int local = first + 64 * part, g = local / 16;
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xa = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(local)]); // A's 32, then B's
        int dot_a = 0, dot_b = 0;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            dot_a = dot4(static_cast<int>(q_a[k]), xa[k], dot_a);
            dot_b = dot4(static_cast<int>(q_b[k]), xa[8 + k], dot_b);
        }
        const int sum_a = st.sum[v][g] + st.sum[v][g + 1], sum_b = st.sum[v][g + 2] + st.sum[v][g + 3];
        acc[v] += st.d[v][local / 256] * (d_a * static_cast<float>(dot_a) + d_b * static_cast<float>(dot_b)
                                          - min_a * static_cast<float>(sum_a) - min_b * static_cast<float>(sum_b));
    }
}

// Part `part` of Q6_K block bb (type_q6_k: half h = part / 2, quarters j = part % 2 and j + 2, which
// share 32 bytes of ql; 32 bytes of qh; a scale a 16 elements). A block is 210 bytes: its loads are as
// aligned as it is.
__host__ __device__ inline q6_k_bytes q6_k_load(const uint8_t * __restrict__ bb, int part) {
    const int h = part >> 1, j = part & 1;
    q6_k_bytes w;
    load_words<32>(w.ql, bb + 64 * h + 32 * j);
    load_words<32>(w.qh, bb + 128 + 32 * h);
    const int8_t * sc = reinterpret_cast<const int8_t *>(bb + 192 + 8 * h + 2 * j); // lo 0, 1; hi 4, 5
    w.sc[0] = sc[0];
    w.sc[1] = sc[1];
    w.sc[2] = sc[4];
    w.sc[3] = sc[5];
    w.d = load_u16(bb + 208);
    return w;
}

// That part's products with x: q - 32 as (dot - 32 sum) in integers, each 16's times its scale, summed
// exactly.
template <int NV, typename Stage>
__host__ __device__ void q6_k_part(const q6_k_bytes & w, int part, int first, const Stage & st, float (&acc)[NV]) {
    const int h = part >> 1, j = part & 1;
    const int sc_lo0 = w.sc[0], sc_lo1 = w.sc[1], sc_hi0 = w.sc[2], sc_hi1 = w.sc[3];
    const float d = half_to_float(w.d);
    uint32_t q_lo[8], q_hi[8];
    PEBBLE_UNROLL
    for (int k = 0; k < 8; k++) {
        q_lo[k] = (w.ql[k] & 0x0f0f0f0fu) | (((w.qh[k] >> (2 * j)) & 0x03030303u) << 4);
        q_hi[k] = ((w.ql[k] >> 4) & 0x0f0f0f0fu) | (((w.qh[k] >> (2 * j + 4)) & 0x03030303u) << 4);
    }
    const int lo_first = first + 128 * h + 32 * j, hi_first = lo_first + 64; // quarters j and j + 2
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xl = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(lo_first)]);
        const int32_t * xh = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(hi_first)]);
        int dot[4] = {0, 0, 0, 0}; // lo 0..15, lo 16..31, hi 0..15, hi 16..31
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            dot[k / 4] = dot4(static_cast<int>(q_lo[k]), xl[k], dot[k / 4]);
            dot[2 + k / 4] = dot4(static_cast<int>(q_hi[k]), xh[k], dot[2 + k / 4]);
        }
        const int32_t * sl = &st.sum[v][lo_first / 16], * sh = &st.sum[v][hi_first / 16];
        const int total = sc_lo0 * (dot[0] - 32 * sl[0]) + sc_lo1 * (dot[1] - 32 * sl[1])
                          + sc_hi0 * (dot[2] - 32 * sh[0]) + sc_hi1 * (dot[3] - 32 * sh[1]);
        acc[v] += st.d[v][first / 256] * (d * static_cast<float>(total));
    }
}

// A block of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) whose element 0 is element `first` of the
// staging, x quantized per 32 as the host quantizes it for these types. Q8_0: an fp16 d, 32 int8 weights.
// The others: fp16 d (and m for Q4_1 and Q5_1; MXFP4's E8M0 byte instead), the 32 fifth bits of Q5_0 and
// Q5_1 (element i's in bit i), then 16 bytes of nibbles, element i's low in byte i and element 16 + i's
// high. Values d q (Q8_0), d (q - 8) (Q4_0), d (q - 16) (Q5_0), d q + m (Q4_1, Q5_1), d values[q] (IQ4_NL,
// MXFP4, whose int8 values go into the dot products as they are: signed times signed).
template <typename T> using block32_of = block32_bytes<T::id == type_q8_0::id ? 32 : 16>;
template <typename T> constexpr bool has_min = T::id == type_q4_1::id || T::id == type_q5_1::id;
template <typename T> constexpr bool has_fifth_bits = T::id == type_q5_0::id || T::id == type_q5_1::id;
template <typename T> constexpr bool has_table = T::id == type_iq4_nl::id || T::id == type_mxfp4::id;
template <typename T> constexpr bool e8m0 = T::id == type_mxfp4::id; // d is one E8M0 byte

template <typename T>
__host__ __device__ inline block32_of<T> block32_load(const uint8_t * __restrict__ bb) {
    constexpr int qs_at = (e8m0<T> ? 1 : 2) + (has_min<T> ? 2 : 0) + (has_fifth_bits<T> ? 4 : 0);
    block32_of<T> w;
    load_words<T::id == type_q8_0::id ? 32 : 16>(w.qs, bb + qs_at);
    w.d = e8m0<T> ? bb[0] : load_u16(bb);
    w.m = has_min<T> ? load_u16(bb + 2) : 0;
    w.qh = has_fifth_bits<T> ? load_high_bits(bb + (has_min<T> ? 4 : 2)) : 0;
    return w;
}

// Bits 4k .. 4k + 3 of qh (the fifth bits of elements 4k .. 4k + 3) as bit 4 of bytes 0..3.
__host__ __device__ inline uint32_t fifth_bits(uint32_t qh, int k) {
    const uint32_t b = (qh >> (4 * k)) & 0xfu;
    return (b & 1u) << 4 | (b & 2u) << 11 | (b & 4u) << 18 | (b & 8u) << 25;
}

template <typename T, int NV, typename Stage>
__host__ __device__ void block32(const block32_of<T> & w, int first, const Stage & st, float (&acc)[NV]) {
    constexpr bool q8 = T::id == type_q8_0::id;
    constexpr int offset = T::id == type_q4_0::id ? 8 : T::id == type_q5_0::id ? 16 : 0; // subtracted from q
    const float d = e8m0<T> ? e8m0_half(w.d) : half_to_float(w.d), m = half_to_float(w.m);
    uint32_t q[8]; // element 4k .. 4k + 3's q (or value) in word k
    if constexpr (has_table<T>) {
        PEBBLE_UNROLL
        for (int k = 0; k < 4; k++) table_lookup<T>(w.qs[k], q[k], q[k + 4]);
    } else {
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            q[k] = q8 ? w.qs[k] : (w.qs[k % 4] >> (4 * (k / 4))) & 0x0f0f0f0fu; // nibbles: low, then high
            if (has_fifth_bits<T>) q[k] |= fifth_bits(w.qh, k);
        }
    }
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xw = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(first)]);
        int dot = 0;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) dot = dot4(static_cast<int>(q[k]), xw[k], dot);
        const int sum = q8 || has_table<T> ? 0 : st.sum[v][first / 16] + st.sum[v][first / 16 + 1];
        const float part = has_min<T> ? d * static_cast<float>(dot) + m * static_cast<float>(sum)
                                      : d * static_cast<float>(dot - offset * sum);
        acc[v] += st.d[v][first / 32] * part;
    }
}

// A lane's part `part` of block bb of type T, loaded; and its products with x.
template <typename T> constexpr bool k45 = T::id == type_q4_k::id || T::id == type_q5_k::id;
template <typename T> struct part_bytes_of { using type = block32_of<T>; };
template <> struct part_bytes_of<type_q4_k> { using type = k_bytes<type_q4_k>; };
template <> struct part_bytes_of<type_q5_k> { using type = k_bytes<type_q5_k>; };
template <> struct part_bytes_of<type_q6_k> { using type = q6_k_bytes; };
template <> struct part_bytes_of<type_q2_k> { using type = q2_k_bytes; };
template <> struct part_bytes_of<type_q3_k> { using type = q3_k_bytes; };
template <> struct part_bytes_of<type_iq4_xs> { using type = iq4_xs_bytes; };

template <typename T>
__host__ __device__ inline typename part_bytes_of<T>::type load_part(const uint8_t * __restrict__ bb, int part) {
    if constexpr (k45<T>) {
        return k_load<T>(bb, part);
    } else if constexpr (T::id == type_q6_k::id) {
        return q6_k_load(bb, part);
    } else if constexpr (T::id == type_q2_k::id) {
        return q2_k_load(bb, part);
    } else if constexpr (T::id == type_q3_k::id) {
        return q3_k_load(bb, part);
    } else if constexpr (T::id == type_iq4_xs::id) {
        return iq4_xs_load(bb, part);
    } else {
        return block32_load<T>(bb);
    }
}

template <typename T, int NV, typename Stage>
__host__ __device__ inline void sum_part(const typename part_bytes_of<T>::type & w, int part, int first,
                                         const Stage & st, float (&acc)[NV]) {
    if constexpr (k45<T>) {
        k_part<T, NV>(w, part, first, st, acc);
    } else if constexpr (T::id == type_q6_k::id) {
        q6_k_part<NV>(w, part, first, st, acc);
    } else if constexpr (T::id == type_q2_k::id) {
        q2_k_part<NV>(w, part, first, st, acc);
    } else if constexpr (T::id == type_q3_k::id) {
        q3_k_part<NV>(w, part, first, st, acc);
    } else if constexpr (T::id == type_iq4_xs::id) {
        iq4_xs_part<NV>(w, part, first, st, acc);
    } else {
        block32<T, NV>(w, first, st, acc);
    }
}

// Lane `lane` (of Lanes)'s parts of the chunk [c0, c0 + n) of the warp's WR rows (w_row, where active),
// x staged in st from element c0, in groups of U: every load of a group goes out before its first part is
// summed, parts and rows summed in the order of one part at a time (the same sums, bit for bit). (On the
// host, for PEBBLING_SIMD=gpu, each of 32 lanes in turn: host_q8_matvec.)
template <typename T, int NV, int WR, int Lanes = warp_lanes, typename Stage>
__host__ __device__ inline void q8_lane_parts(const uint8_t * const (&w_row)[WR], const bool (&active)[WR], int64_t c0,
                                              int n, int lane, const Stage & st, float (&acc)[WR][NV]) {
    constexpr int part_elements = T::block_elements / T::parts, U = part_loads<WR>;
    const int64_t p_end = (c0 + n) / part_elements;
    for (int64_t p0 = c0 / part_elements + lane; p0 < p_end; p0 += int64_t(U) * Lanes) {
        typename part_bytes_of<T>::type w[U][WR];
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int64_t p = p0 + int64_t(u) * Lanes;
            if (p >= p_end) break;
            PEBBLE_UNROLL
            for (int r = 0; r < WR; r++) {
                if (active[r]) w[u][r] = load_part<T>(w_row[r] + p / T::parts * T::block_bytes,
                                                      static_cast<int>(p % T::parts));
            }
        }
        PEBBLE_UNROLL
        for (int u = 0; u < U; u++) {
            const int64_t p = p0 + int64_t(u) * Lanes;
            if (p >= p_end) break;
            const int64_t block = p / T::parts;
            const int first = static_cast<int>(block * T::block_elements - c0), part = static_cast<int>(p % T::parts);
            PEBBLE_UNROLL
            for (int r = 0; r < WR; r++) {
                if (active[r]) sum_part<T, NV>(w[u][r], part, first, st, acc[r]);
            }
        }
    }
}

} // namespace pebble_internal

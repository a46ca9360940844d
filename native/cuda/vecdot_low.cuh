// cuda/vecdot_low.cuh: a lane's part of a row of Q2_K, Q3_K or IQ4_XS weights times x quantized to 8 bits per
// 256 elements, for cuda/vecdot.cuh's q8_lane_parts (load_part and sum_part): the part's bytes loaded into
// registers, then its exact integer dot products with x's quants and x's 16-element sums, scaled in float once
// a part. Their blocks (84, 110 and 136 bytes) put a part's fields at 4-, 2- and 8-byte alignment at best, so
// they are read with load_words and load_u32, which take what each address allows. __host__ __device__, as
// vecdot.cuh's. Not part of the ABI.
#pragma once

#include "cuda/quants.cuh"

#include <cstdint>

namespace pebble_internal {

// ---------------------------------------------------------------------------------------------------
// Q2_K

// Part `part` of a Q2_K block (type_q2_k: h = part / 2, s = 2 (part % 2) and s + 1): the 32 bytes of qs it
// shares with the part beside it, its four (scale, min) bytes, and d and dmin.
struct q2_k_bytes { uint32_t qs[8], sc, dm; };

__host__ __device__ inline q2_k_bytes q2_k_load(const uint8_t * __restrict__ bb, int part) {
    q2_k_bytes w;
    load_words<32>(w.qs, bb + 16 + 32 * (part >> 1));
    w.sc = load_u32(bb + 4 * part);
    w.dm = load_u32(bb + 80);
    return w;
}

// That part's products with x, whose element 0 is element `first` of the staging st: d times the sum of
// scale_g dot_g less dmin times the sum of min_g sum_g, over its four groups of 16 (both sums exact in int).
template <int NV, typename Stage>
__host__ __device__ void q2_k_part(const q2_k_bytes & w, int part, int first, const Stage & st, float (&acc)[NV]) {
    const int shift = 4 * (part & 1);
    const float d = half_to_float(static_cast<uint16_t>(w.dm)), dmin = half_to_float(static_cast<uint16_t>(w.dm >> 16));
    uint32_t q_a[8], q_b[8]; // bits s and s + 1 of the part's 32 bytes: its elements 0..31, then 32..63
    PEBBLE_UNROLL
    for (int k = 0; k < 8; k++) {
        q_a[k] = (w.qs[k] >> shift) & 0x03030303u;
        q_b[k] = (w.qs[k] >> (shift + 2)) & 0x03030303u;
    }
    const int local = first + 64 * part, g = local / 16;
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xa = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(local)]); // 64 in a row
        int dot[4] = {0, 0, 0, 0}; // the part's groups of 16
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            dot[k / 4] = dot4(static_cast<int>(q_a[k]), xa[k], dot[k / 4]);
            dot[2 + k / 4] = dot4(static_cast<int>(q_b[k]), xa[8 + k], dot[2 + k / 4]);
        }
        int scaled = 0, mins = 0;
        PEBBLE_UNROLL
        for (int j = 0; j < 4; j++) {
            scaled += static_cast<int>((w.sc >> (8 * j)) & 0xf) * dot[j];
            mins += static_cast<int>((w.sc >> (8 * j + 4)) & 0xf) * st.sum[v][g + j];
        }
        acc[v] += st.d[v][local / 256] * (d * static_cast<float>(scaled) - dmin * static_cast<float>(mins));
    }
}

// ---------------------------------------------------------------------------------------------------
// Q3_K

// Part `part` of a Q3_K block (type_q3_k: h = part / 2, s = 2 (part % 2) and s + 1): all 32 bytes of hmask,
// the 32 of qs it shares with the part beside it, the two words of scale bits its scales are in, and d.
struct q3_k_bytes { uint32_t hm[8], qs[8], sc_low, sc_high; uint16_t d; };

__host__ __device__ inline q3_k_bytes q3_k_load(const uint8_t * __restrict__ bb, int part) {
    q3_k_bytes w;
    load_words<32>(w.hm, bb);
    load_words<32>(w.qs, bb + 32 + 32 * (part >> 1));
    w.sc_low = load_u32(bb + 96 + 4 * (part & 1));
    w.sc_high = load_u32(bb + 104);
    w.d = load_u16(bb + 108);
    return w;
}

// That part's products with x: q + 4 (0..7, the low bits with the high bit above them) in the dot products,
// the offset as 4 sum; d times the sum of scale_g (dot_g - 4 sum_g) over its four groups.
template <int NV, typename Stage>
__host__ __device__ void q3_k_part(const q3_k_bytes & w, int part, int first, const Stage & st, float (&acc)[NV]) {
    const int h = part >> 1, s = 2 * (part & 1);
    uint32_t q_a[8], q_b[8];
    PEBBLE_UNROLL
    for (int k = 0; k < 8; k++) {
        q_a[k] = ((w.qs[k] >> (2 * s)) & 0x03030303u) | ((w.hm[k] >> (4 * h + s)) & 0x01010101u) << 2;
        q_b[k] = ((w.qs[k] >> (2 * s + 2)) & 0x03030303u) | ((w.hm[k] >> (4 * h + s + 1)) & 0x01010101u) << 2;
    }
    int sc[4];
    PEBBLE_UNROLL
    for (int j = 0; j < 4; j++) sc[j] = type_q3_k::scale(w.sc_low, w.sc_high, part, j);
    const float d = half_to_float(w.d);
    const int local = first + 64 * part, g = local / 16;
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xa = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(local)]);
        int dot[4] = {0, 0, 0, 0};
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            dot[k / 4] = dot4(static_cast<int>(q_a[k]), xa[k], dot[k / 4]);
            dot[2 + k / 4] = dot4(static_cast<int>(q_b[k]), xa[8 + k], dot[2 + k / 4]);
        }
        int total = 0;
        PEBBLE_UNROLL
        for (int j = 0; j < 4; j++) total += sc[j] * (dot[j] - 4 * st.sum[v][g + j]);
        acc[v] += st.d[v][local / 256] * (d * static_cast<float>(total));
    }
}

// ---------------------------------------------------------------------------------------------------
// IQ4_XS

// Part `part` of an IQ4_XS block (type_iq4_xs: sub-blocks 2 part and 2 part + 1): its 32 bytes of nibbles,
// and the block's first 8 bytes (d, the scales' top bits, their low nibbles).
struct iq4_xs_bytes { uint32_t qs[8], head, low; };

__host__ __device__ inline iq4_xs_bytes iq4_xs_load(const uint8_t * __restrict__ bb, int part) {
    iq4_xs_bytes w;
    load_words<32>(w.qs, bb + 8 + 32 * part);
    w.head = load_u32(bb);
    w.low = load_u32(bb + 4);
    return w;
}

// That part's products with x: the table's int8 values, looked up once a part, in signed dot products; d
// times the sum of (scale_j - 32) dot_j over its two sub-blocks.
template <int NV, typename Stage>
__host__ __device__ void iq4_xs_part(const iq4_xs_bytes & w, int part, int first, const Stage & st, float (&acc)[NV]) {
    uint32_t values[16]; // the part's 64 values, four a word in element order
    PEBBLE_UNROLL
    for (int k = 0; k < 4; k++) {
        table_lookup<type_iq4_nl>(w.qs[k], values[k], values[4 + k]);          // sub-block A
        table_lookup<type_iq4_nl>(w.qs[4 + k], values[8 + k], values[12 + k]); // sub-block B
    }
    const int sc_a = type_iq4_xs::scale(w.head, w.low, 2 * part), sc_b = type_iq4_xs::scale(w.head, w.low, 2 * part + 1);
    const float d = half_to_float(static_cast<uint16_t>(w.head));
    const int local = first + 64 * part;
    PEBBLE_UNROLL
    for (int v = 0; v < NV; v++) {
        const int32_t * xa = reinterpret_cast<const int32_t *>(&st.q[v][staged_at<1>(local)]);
        int dot_a = 0, dot_b = 0;
        PEBBLE_UNROLL
        for (int k = 0; k < 8; k++) {
            dot_a = dot4(static_cast<int>(values[k]), xa[k], dot_a);
            dot_b = dot4(static_cast<int>(values[8 + k]), xa[8 + k], dot_b);
        }
        acc[v] += st.d[v][local / 256] * (d * static_cast<float>(sc_a * dot_a + sc_b * dot_b));
    }
}

} // namespace pebble_internal

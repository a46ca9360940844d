// cuda/decode_step.cu: the decode step of pebble.h: every layer of a model for a batch of tokens, one
// token a sequence, in one call. At batch 1 every operation of a layer is small, and what costs is
// launching it; here the whole layer is enqueued from C: RMS norm, Q/K/V projections, biases, per-head Q/K
// norms where given, RoPE with the new K/V rows written into the caches (a ring's row pos % n_ctx),
// attention (soft-capped where asked), the output projection, its norm where given and the residual, RMS
// norm, the SwiGLU or GELU-tanh gated feed-forward (or a layer of experts: cuda/experts.cu; or both, Gemma 4's
// 26B-A4B, each half normed and added), its norm where given and its residual; then the output norm and the
// logits. Each operation is a launcher of cuda/ops.cuh.
// A streamed layer's weights and caches come from the store into one of two slots, the next one's restore
// overlapping this one's compute, its new K/V rows written back after. The arithmetic, and its order, is
// pyplugin.model's forward pass on the CPU path with quantized weights: float32 throughout, the vectors
// that enter a matrix kernel rounded to fp16, probabilities normalised before they weight V.

#include "cuda/decoder.cuh"
#include "cuda/ops.cuh"
#include "pebble_kv.h"

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <vector>

using namespace pebble_internal;

namespace pebble_internal {

const char * const weight_names[PEBBLE_LAYER_WEIGHTS] = {
    "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv", "q_norm",
    "k_norm", "post_attn_norm", "post_ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
    "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "attn_sinks", "bo", "ffn_gate_inp_b",
    "ffn_gate_exps_b", "ffn_up_exps_b", "ffn_down_exps_b", "per_layer_inp_gate", "per_layer_proj", "per_layer_post_norm",
    "out_scale", "ffn_gate_inp_s", "ffn_pre_norm_2", "ffn_post_norm_1", "ffn_post_norm_2", "ffn_down_exps_s"};

} // namespace pebble_internal

namespace {

// Whether a streamed layer's slot takes field f of its weights: the entries it names, but not the merged
// experts it reads expert by expert (experts_stored 2).
bool streams_field(const pebble_step_layer & L, int f) {
    if (L.weight_ids[f] < 0) return false;
    return L.experts_stored != 2 || (f != merged_expert_fields[0] && f != merged_expert_fields[1] &&
                                     f != merged_expert_fields[2]);
}

// One layer for the n tokens of a step (the arguments checked).
pebble_status step_layer(pebble_decoder & d, int32_t i, int32_t n, const int32_t * seqs,
                         [[maybe_unused]] const int64_t * host_pos, float * x, cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_layer_shape & s = L.shape;
    const pebble_layer_weights & w = L.weights;
    const int32_t kv_type = d.model.kv_type, n_seq = d.model.n_seq;
    const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
    act_t * h16 = at_offset<act_t>(d.scratch, d.at.h16);
    float * fq = at_offset<float>(d.scratch, d.at.q), * fk = at_offset<float>(d.scratch, d.at.k);
    float * fv = at_offset<float>(d.scratch, d.at.v), * q_rot = at_offset<float>(d.scratch, d.at.q_rot);
    float * scores = at_offset<float>(d.scratch, d.at.scores), * o = at_offset<float>(d.scratch, d.at.o);
    float * gate = at_offset<float>(d.scratch, d.at.gate), * up = at_offset<float>(d.scratch, d.at.up);
    float * k_new = at_offset<float>(d.scratch, d.at.kv_new), * v_new = k_new + int64_t(n) * kv;
    float * parts = switches().split ? at_offset<float>(d.scratch, d.at.parts) : nullptr;

    // attention; a layer reading another's caches (Gemma 4's kv_layer) computes q alone and writes no row
    const bool reader = s.kv_layer >= 0;
    const int64_t kv_written = reader ? 0 : kv, src = reader ? s.kv_layer : i;
    TRY(norm_rows(x, n, e, w.attn_norm, s.rms_eps, h16, stream));
    const matvec_part qkv[3] = {{w.wq.ggml_type, w.wq.data, q, fq}, {w.wk.ggml_type, w.wk.data, kv, fk},
                                {w.wv.ggml_type, w.wv.data, kv, fv}};
    TRY(matvec_parts(qkv, reader ? 1 : w.wv.data ? 3 : 2, e, h16, n, stream));
    if (s.v_norm && !reader) TRY(v_norm(w.wv.data ? fv : fk, fv, n * s.n_head_kv, s.head_dim, s.rms_eps, stream));
    if (w.q_norm.data) TRY(head_norm(fq, n * s.n_head, s.head_dim, w.q_norm, s.rms_eps, stream));
    if (w.k_norm.data) TRY(head_norm(fk, n * s.n_head_kv, s.head_dim, w.k_norm, s.rms_eps, stream));
    void * k_of[PEBBLE_DECODER_MAX_BATCH], * v_of[PEBBLE_DECODER_MAX_BATCH];
    const int64_t * dev_pos = at_offset<int64_t>(d.scratch, d.at.pos); // the step's positions, on the device
    for (int32_t b = 0; b < n; b++) {
        k_of[b] = d.k[size_t(src) * n_seq + seqs[b]];
        v_of[b] = d.v[size_t(src) * n_seq + seqs[b]];
    }
    auto qkv_of = [&](int64_t b) {
        return qkv_args{fq + b * q, fk + b * kv, fv + b * kv, w.bq, w.bk, w.bv, static_cast<int32_t>(q),
                        static_cast<int32_t>(kv_written), s.head_dim, s.rope_dims, s.rope_neox, L.rope_cos,
                        L.rope_sin, dev_pos + b, q_rot + b * q, k_new + b * kv, v_new + b * kv};
    };
    auto kv_row_of = [&](int64_t b) {
        return kv_row_args{k_new + b * kv, v_new + b * kv, k_of[b], v_of[b], kv_type, kv_written, dev_pos + b,
                           L.kv_rows, s.ring};
    };
    qkv_args qkv_at[PEBBLE_DECODER_MAX_BATCH];
    kv_row_args kv_row_at[PEBBLE_DECODER_MAX_BATCH];
    for (int32_t b = 0; b < n; b++) {
        qkv_at[b] = qkv_of(b);
        kv_row_at[b] = kv_row_of(b);
    }
    TRY(rope_and_store(n, qkv_at, kv_row_at, stream));
    const float * sinks = static_cast<const float *>(w.attn_sinks.data); // F32 (check_layer), or NULL
    auto attention_of = [&](int32_t b) { // act_t is float on the host: its rows go to out_f32 there
        return attention_args{q_rot + b * q, k_of[b], v_of[b], kv_type, s.n_head, s.n_head_kv, s.head_dim, 0,
                              L.kv_rows, L.attn_scale, s.attn_softcap, sinks, scores + int64_t(b) * s.n_head * L.kv_rows,
#ifdef PEBBLE_HOST_BUILD
                              nullptr, h16 + b * q,
#else
                              h16 + b * q, nullptr,
#endif
                              dev_pos + b, parts ? parts + b * d.parts_per_seq : nullptr};
    };
#ifdef PEBBLE_HOST_BUILD
    if (host_runs_gpu_kernels()) { // the GPU's kernels (attention)
        TRY(attention_in_groups(n, attention_of, stream));
    } else {
        int64_t n_pos[PEBBLE_DECODER_MAX_BATCH];
        for (int32_t b = 0; b < n; b++) n_pos[b] = std::min(host_pos[b] + 1, L.kv_rows); // a ring's filled rows
        TRY(pebble_cpu::attend(n, q_rot, kv_type, k_of, v_of, n_pos, L.kv_rows, s.n_head, s.n_head_kv,
                               s.head_dim, L.attn_scale, s.attn_softcap, h16, scores, sinks));
    }
#else
    TRY(attention_in_groups(n, attention_of, stream));
#endif
    TRY(matvec_many(w.wo.ggml_type, w.wo.data, e, q, h16, n, o, stream));
    if (w.bo.data) TRY(add_bias(o, n, e, w.bo, 0, stream));

    // feed-forward, its norm in one launch with the attention's residual where that has no norm of its own
    if (w.post_attn_norm.data) {
        TRY(residual(x, o, n, e, w.post_attn_norm, s, stream));
        TRY(norm_rows(x, n, e, w.ffn_norm, s.rms_eps, h16, stream));
    } else {
        TRY(add_norm_rows(x, o, n, e, s.residual_scale, w.ffn_norm, s.rms_eps, h16, stream));
    }
    auto dense_ffn = [&](float * into) { // the gated FFN of h16 (which it overwrites) into `into`
        const matvec_part gate_up[2] = {{w.w_gate.ggml_type, w.w_gate.data, s.n_ff, gate},
                                        {w.w_up.ggml_type, w.w_up.data, s.n_ff, up}};
        TRY(matvec_parts(gate_up, 2, e, h16, n, stream));
        const int64_t ff = int64_t(n) * s.n_ff;
        TRY(gate_times_up(s.activation, gate, up, ff, h16, stream));
        return matvec_many(w.w_down.ggml_type, w.w_down.data, e, s.n_ff, h16, n, into, stream);
    };
    if (s.n_expert && w.w_gate.data) {
        // Gemma 4's 26B-A4B: the experts on x normed by ffn_pre_norm_2 (routed by router_input) into o, then the
        // dense FFN on x normed by ffn_norm into the experts' y (free again), then o = rms_norm(dense) *
        // ffn_post_norm_1 + rms_norm(experts) * ffn_post_norm_2; the post_ffn_norm and residual below.
        float * dense = at_offset<float>(d.scratch, d.at.y);
        TRY(norm_rows(x, n, e, w.ffn_pre_norm_2, s.rms_eps, h16, stream));
        TRY(experts_ffn(d, i, n, h16, x, o, stream));
        TRY(norm_rows(x, n, e, w.ffn_norm, s.rms_eps, h16, stream));
        TRY(dense_ffn(dense));
        TRY(two_norms_add(o, dense, n, e, w.ffn_post_norm_2, w.ffn_post_norm_1, s.rms_eps, stream));
    } else if (s.n_expert) {
        TRY(experts_ffn(d, i, n, h16, x, o, stream));
    } else {
        TRY(dense_ffn(o));
    }
    TRY(residual(x, o, n, e, w.post_ffn_norm, s, stream));
    if (w.per_layer_inp_gate.data) { // Gemma 4's per-layer embedding: its inputs follow the hidden states in x
        const int64_t pl = d.model.n_embd_per_layer;
        TRY(to_act(x, n * e, h16, stream));
        TRY(matvec_many(w.per_layer_inp_gate.ggml_type, w.per_layer_inp_gate.data, pl, e, h16, n, gate, stream));
        TRY(gather_rows(x + int64_t(n) * e + int64_t(i) * pl, int64_t(d.model.n_layer) * pl, n, pl, up, stream));
        TRY(gate_times_up(1, gate, up, int64_t(n) * pl, h16, stream));
        TRY(matvec_many(w.per_layer_proj.ggml_type, w.per_layer_proj.data, e, pl, h16, n, o, stream));
        pebble_layer_shape unscaled = s; // its norm's add is not a block's residual: never scaled
        unscaled.residual_scale = 1.0f;
        TRY(residual(x, o, n, e, w.per_layer_post_norm, unscaled, stream));
    }
    if (w.out_scale.data) TRY(scale_by(x, int64_t(n) * e, w.out_scale, stream));
    return PEBBLE_OK;
}

// The fields of pebble_layer_weights in their order (pebble_step_layer.weight_ids).
pebble_tensor_ref pebble_layer_weights::* const weight_fields[PEBBLE_LAYER_WEIGHTS] = {
    &pebble_layer_weights::attn_norm, &pebble_layer_weights::wq, &pebble_layer_weights::wk,
    &pebble_layer_weights::wv, &pebble_layer_weights::wo, &pebble_layer_weights::ffn_norm,
    &pebble_layer_weights::w_gate, &pebble_layer_weights::w_up, &pebble_layer_weights::w_down,
    &pebble_layer_weights::bq, &pebble_layer_weights::bk, &pebble_layer_weights::bv,
    &pebble_layer_weights::q_norm, &pebble_layer_weights::k_norm, &pebble_layer_weights::post_attn_norm,
    &pebble_layer_weights::post_ffn_norm, &pebble_layer_weights::ffn_gate_inp, &pebble_layer_weights::ffn_gate_exps,
    &pebble_layer_weights::ffn_up_exps, &pebble_layer_weights::ffn_down_exps, &pebble_layer_weights::ffn_gate_inp_shexp,
    &pebble_layer_weights::ffn_gate_shexp, &pebble_layer_weights::ffn_up_shexp, &pebble_layer_weights::ffn_down_shexp,
    &pebble_layer_weights::attn_sinks, &pebble_layer_weights::bo, &pebble_layer_weights::ffn_gate_inp_b,
    &pebble_layer_weights::ffn_gate_exps_b, &pebble_layer_weights::ffn_up_exps_b, &pebble_layer_weights::ffn_down_exps_b,
    &pebble_layer_weights::per_layer_inp_gate, &pebble_layer_weights::per_layer_proj,
    &pebble_layer_weights::per_layer_post_norm, &pebble_layer_weights::out_scale, &pebble_layer_weights::ffn_gate_inp_s,
    &pebble_layer_weights::ffn_pre_norm_2, &pebble_layer_weights::ffn_post_norm_1, &pebble_layer_weights::ffn_post_norm_2,
    &pebble_layer_weights::ffn_down_exps_s};

// The bytes of one of layer i's caches (0 for a layer reading another's: it keeps none).
uint64_t kv_cache_bytes(const pebble_decoder & d, int32_t i) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    if (L.shape.kv_layer >= 0) return 0;
    return uint64_t(L.kv_rows) * uint64_t(kv_bytes(d.model.kv_type, int64_t(L.shape.n_head_kv) * L.shape.head_dim));
}

#ifdef PEBBLE_HOST_BUILD
#    define COPY_STREAM(d) nullptr
#else
#    define COPY_STREAM(d) static_cast<void *>((d).copy)
#endif

// The n-th streamed layer's weights, and the rows each token of the step has written before its
// position, copied from the store into its slot (on the copy stream, after the slot's last layer
// computed); the slot's ready event recorded after them.
pebble_status restore_streamed(pebble_decoder & d, int32_t n, int32_t n_tok, const int32_t * seqs, const int64_t * pos) {
    const int32_t i = d.streamed[size_t(n)];
    [[maybe_unused]] const int32_t slot = n % 2;
    const pebble_step_layer & L = d.layers[size_t(i)];
    char where[96];
#ifndef PEBBLE_HOST_BUILD
    if (cudaStreamWaitEvent(d.copy, d.slot_free[slot], 0) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d: the copy stream could not wait for slot %d", i,
                    slot);
    }
#endif
    for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
        if (!streams_field(L, f)) continue;
        const pebble_tensor_ref & ref = L.weights.*weight_fields[f];
        pebble_status st = pebble_restore(d.model.store, i, L.weight_ids[f], const_cast<void *>(ref.data),
                                          d.weight_bytes[size_t(i)][size_t(f)], COPY_STREAM(d));
        if (st != PEBBLE_OK) {
            snprintf(where, sizeof where, "pebble_decoder_step: layer %d: %s", i, weight_names[f]);
            return with_place(st, where);
        }
    }
    const uint64_t row_bytes = kv_cache_bytes(d, i) / uint64_t(L.kv_rows);
    for (int32_t b = 0; b < n_tok && row_bytes; b++) { // a reader of another's caches has none to restore
        const uint64_t held = uint64_t(std::min(pos[b], L.kv_rows)); // a ring holds its window at most
        for (int kv = 0; kv < 2 && held; kv++) {
            void * cache = (kv ? d.v : d.k)[size_t(i) * d.model.n_seq + seqs[b]];
            pebble_status st = pebble_read(d.model.store, i, d.model.kv_ids[2 * seqs[b] + kv], 0, cache,
                                           held * row_bytes, COPY_STREAM(d));
            if (st != PEBBLE_OK) {
                snprintf(where, sizeof where, "pebble_decoder_step: layer %d: sequence %d's %s cache", i, seqs[b],
                         kv ? "V" : "K");
                return with_place(st, where);
            }
        }
    }
#ifndef PEBBLE_HOST_BUILD
    if (cudaEventRecord(d.slot_ready[slot], d.copy) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d: slot %d's ready event", i, slot);
    }
#endif
    return PEBBLE_OK;
}

// After the n-th streamed layer computed on `stream`: each token's new K and V row written back to the
// store (on the copy stream, after the compute), then the streamed layer two on restored into the slot.
pebble_status after_streamed(pebble_decoder & d, int32_t n, int32_t n_tok, const int32_t * seqs, const int64_t * pos,
                             [[maybe_unused]] cudaStream_t stream) {
    const int32_t i = d.streamed[size_t(n)];
    [[maybe_unused]] const int32_t slot = n % 2;
    const pebble_step_layer & L = d.layers[size_t(i)];
#ifndef PEBBLE_HOST_BUILD
    if (cudaEventRecord(d.slot_free[slot], stream) != cudaSuccess ||
        cudaStreamWaitEvent(d.copy, d.slot_free[slot], 0) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d: the copy stream could not wait for its compute", i);
    }
#endif
    const uint64_t row_bytes = kv_cache_bytes(d, i) / uint64_t(L.kv_rows);
    for (int32_t b = 0; b < n_tok && row_bytes; b++) { // nor to write back
        const uint64_t row = uint64_t(L.shape.ring ? pos[b] % L.kv_rows : pos[b]);
        for (int kv = 0; kv < 2; kv++) {
            const uint8_t * cache = static_cast<const uint8_t *>((kv ? d.v : d.k)[size_t(i) * d.model.n_seq + seqs[b]]);
            pebble_status st = pebble_write(d.model.store, i, d.model.kv_ids[2 * seqs[b] + kv], row * row_bytes,
                                            cache + row * row_bytes, row_bytes, COPY_STREAM(d));
            if (st != PEBBLE_OK) {
                char where[96];
                snprintf(where, sizeof where, "pebble_decoder_step: layer %d: writing back sequence %d's %s row", i,
                         seqs[b], kv ? "V" : "K");
                return with_place(st, where);
            }
        }
    }
    if (size_t(n) + 2 < d.streamed.size()) TRY(restore_streamed(d, n + 2, n_tok, seqs, pos));
    return PEBBLE_OK;
}

} // namespace

namespace pebble_internal {

// The whole step enqueued on `stream`: every layer, then the output norm and logits where asked. The
// positions are in the scratch's pos (device memory) already; host_pos is the same, for the host build's
// attention.
pebble_status enqueue_step(pebble_decoder & d, int32_t n, const int32_t * seqs, const int64_t * host_pos, float * x,
                           float * logits, cudaStream_t stream) {
    const pebble_step_model & m = d.model;
    for (int32_t k = 0; k < 2 && size_t(k) < d.streamed.size(); k++) TRY(restore_streamed(d, k, n, seqs, host_pos));
    for (int32_t i = 0; i < m.n_layer; i++) {
        const int32_t order = d.stream_order[size_t(i)];
#ifndef PEBBLE_HOST_BUILD
        if (order >= 0 && cudaStreamWaitEvent(stream, d.slot_ready[order % 2], 0) != cudaSuccess) {
            cudaGetLastError();
            return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: layer %d could not wait for its slot", i);
        }
#endif
        if (m.expert_prefetch && d.layers[size_t(i)].experts_stored) TRY(prefetch_experts(d, i, n, x, stream));
        TRY(step_layer(d, i, n, seqs, host_pos, x, stream));
        if (order >= 0) TRY(after_streamed(d, order, n, seqs, host_pos, stream));
    }
#ifndef PEBBLE_HOST_BUILD
    // The step ends after its write-backs too, so that whoever waits for it may reuse the slots.
    if (!d.streamed.empty() && (cudaEventRecord(d.copied, d.copy) != cudaSuccess ||
                                cudaStreamWaitEvent(stream, d.copied, 0) != cudaSuccess)) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "pebble_decoder_step: the step could not wait for its write-backs");
    }
#endif
    if (logits) {
        act_t * h16 = at_offset<act_t>(d.scratch, d.at.h16);
        TRY(norm_rows(x, n, m.n_embd, m.output_norm, m.rms_eps, h16, stream));
        TRY(matvec_many(m.output.ggml_type, m.output.data, m.n_vocab, m.n_embd, h16, n, logits, stream));
        if (m.logit_scale != 1.0f || m.final_softcap > 0.0f) {
            const int64_t total = int64_t(n) * m.n_vocab;
            TRY(scale_logits(logits, total, m.logit_scale, m.final_softcap, stream));
        }
    }
    return PEBBLE_OK;
}

// A streamed layer as the store holds it: each weight's entry size, checked against its type and shape,
// and a stand-in pointer for the checks until its slot is placed (place_streamed).
pebble_status describe_streamed(pebble_decoder & d, const char * fn, int32_t i) {
    pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_step_model & m = d.model;
    if (!m.store || !m.kv_ids) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d is streamed: the model's store and kv_ids must not be "
                    "NULL", fn, i);
    }
    const pebble_layer_shape & s = L.shape;
    const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
    const int64_t E = s.n_expert, fx = s.n_ff_exp, sh = s.n_ff_shexp;
    const int64_t pl = m.n_embd_per_layer;
    const int64_t rows[PEBBLE_LAYER_WEIGHTS] = {1, q, kv, kv, e, 1, s.n_ff, s.n_ff, e, 1, 1, 1, 1, 1, 1, 1,
                                                E, E * fx, E * fx, E * e, 1, sh, sh, e, 1, 1, 1, 1, 1, 1,
                                                pl, e, 1, 1, 1, 1, 1, 1, 1};
    const int64_t cols[PEBBLE_LAYER_WEIGHTS] = {e, e, e, e, q, e, e, e, s.n_ff, q, kv, kv, s.head_dim, s.head_dim, e, e,
                                                e, e, e, fx, e, e, e, sh, s.n_head, e, E, E * fx, E * fx, E * e,
                                                e, pl, e, 1, e, e, e, e, E};
    for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
        pebble_tensor_ref & ref = L.weights.*weight_fields[f];
        ref.data = nullptr;
        if (!streams_field(L, f)) continue;
        struct pebble_entry_info info{};
        const pebble_status st = pebble_entry_info(m.store, i, L.weight_ids[f], &info);
        if (st != PEBBLE_OK) {
            char where[96];
            snprintf(where, sizeof where, "%s: layer %d: %s", fn, i, weight_names[f]);
            return with_place(st, where);
        }
        int64_t elements = 0, block = 0;
        if (pebble_type_block(ref.ggml_type, &elements, &block) != PEBBLE_OK || cols[f] % elements != 0 ||
            info.nbytes != uint64_t(rows[f]) * uint64_t(cols[f] / elements) * uint64_t(block)) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d: %s's entry (tensor %d) holds %" PRIu64 " bytes, not "
                        "%" PRId64 " x %" PRId64 " of GGUF type %d (%s)", fn, i, weight_names[f], L.weight_ids[f],
                        info.nbytes, rows[f], cols[f], ref.ggml_type, ggml_type_name(ref.ggml_type));
        }
        d.weight_bytes[size_t(i)][size_t(f)] = info.nbytes;
        ref.data = &d; // a stand-in until the slot is placed: never read
    }
    for (int32_t seq = 0; seq < m.n_seq && s.kv_layer < 0; seq++) { // a reader of another's caches has no entries
        for (int kv_i = 0; kv_i < 2; kv_i++) {
            struct pebble_entry_info info{};
            const int32_t id = m.kv_ids[2 * seq + kv_i];
            if (pebble_entry_info(m.store, i, id, &info) != PEBBLE_OK || info.nbytes != kv_cache_bytes(d, i)) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d: sequence %d's %s cache (tensor %d) is not an "
                            "entry of %" PRIu64 " bytes", fn, i, seq, kv_i ? "V" : "K", id, kv_cache_bytes(d, i));
            }
        }
    }
    d.stream_order[size_t(i)] = static_cast<int32_t>(d.streamed.size());
    d.streamed.push_back(i);
    return PEBBLE_OK;
}

// Each streamed layer's weights and caches at their places in its slot (weights first, then each
// sequence's K and V), and the slots (as large as the largest layer) made.
pebble_status place_streamed(pebble_decoder & d, const char * fn) {
    const int32_t n_seq = d.model.n_seq;
    std::vector<std::vector<uint64_t>> offsets(d.streamed.size());
    for (size_t n = 0; n < d.streamed.size(); n++) {
        const int32_t i = d.streamed[n];
        uint64_t at = 0;
        for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
            offsets[n].push_back(at);
            at += aligned(d.weight_bytes[size_t(i)][size_t(f)]);
        }
        for (int32_t seq = 0; seq < 2 * n_seq; seq++) { // (none for a reader of another's caches)
            offsets[n].push_back(at);
            at += aligned(kv_cache_bytes(d, i));
        }
        d.slot_bytes = std::max(d.slot_bytes, at);
    }
    const size_t n_slots = std::min<size_t>(2, d.streamed.size());
    if (d.model.slots[0]) { // the caller's
        for (size_t k = 0; k < n_slots; k++) {
            if (!d.model.slots[k] || d.model.slot_bytes < d.slot_bytes) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: %zu slots of at least %" PRIu64 " bytes are needed for the "
                            "streamed layers; slot %zu is %s of %" PRIu64, fn, n_slots, d.slot_bytes, k,
                            d.model.slots[k] ? "one" : "NULL, the other", d.model.slot_bytes);
            }
#ifndef PEBBLE_HOST_BUILD
            TRY(check_device_pointer(d.model.slots[k], "a slot", fn));
#endif
            d.slots_given[k] = static_cast<uint8_t *>(d.model.slots[k]);
        }
    } else {
        for (size_t k = 0; k < n_slots; k++) TRY(alloc_scratch(&d.slots[k], d.slot_bytes));
    }
    for (size_t n = 0; n < d.streamed.size(); n++) {
        const int32_t i = d.streamed[n];
        uint8_t * base = d.slots_given[0] ? d.slots_given[n % 2] : d.slots[n % 2];
        pebble_step_layer & L = d.layers[size_t(i)];
        for (int f = 0; f < PEBBLE_LAYER_WEIGHTS; f++) {
            pebble_tensor_ref & ref = L.weights.*weight_fields[f];
            if (ref.data) ref.data = base + offsets[n][size_t(f)];
        }
        for (int32_t seq = 0; seq < n_seq && L.shape.kv_layer < 0; seq++) {
            d.k[size_t(i) * n_seq + seq] = base + offsets[n][PEBBLE_LAYER_WEIGHTS + 2 * seq];
            d.v[size_t(i) * n_seq + seq] = base + offsets[n][PEBBLE_LAYER_WEIGHTS + 2 * seq + 1];
        }
    }
#ifndef PEBBLE_HOST_BUILD
    if (cudaStreamCreateWithFlags(&d.copy, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_ready[0], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_ready[1], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_free[0], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.slot_free[1], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d.copied, cudaEventDisableTiming) != cudaSuccess) {
        const cudaError_t err = cudaGetLastError();
        return fail(PEBBLE_ERR_CUDA, "%s: the slots' copy stream or events could not be made: %s", fn,
                    cudaGetErrorString(err));
    }
#else
    (void)fn;
#endif
    return PEBBLE_OK;
}

} // namespace pebble_internal

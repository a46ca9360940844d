// cuda/decoder.cu: the decode step's ABI (pebble_decoder_create, pebble_decoder_step, pebble_decoder_stats,
// pebble_decoder_free): a model's layers, weights and caches checked once and held by a handle, with the
// scratch its steps compute in (laid out once, part by part: pyplugin/store/decoder_scratch.py mirrors
// it), its experts' and streamed layers' slots, and on the GPU its stream, events and pinned positions;
// then each step's tokens checked and the step run (cuda/decode_step.cu), directly or through a CUDA graph
// (cuda/graph.cu). Handles are ids, never reused, so that a freed decoder is detected rather than
// dereferenced.

#include "cuda/decoder.cuh"
#include "cuda/ops.cuh"
#include "cuda/quants.cuh"
#include "pebble_kv.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

using namespace pebble_internal;

namespace pebble_internal {

// The last failure's message again, after `where` (the message is copied first: fail writes the same buffer).
pebble_status with_place(pebble_status st, const char * where) {
    char message[512];
    snprintf(message, sizeof message, "%s", pebble_last_error());
    return fail(st, "%s: %s", where, message);
}

pebble_status alloc_scratch(uint8_t ** out, uint64_t bytes) {
#ifdef PEBBLE_HOST_BUILD
    *out = static_cast<uint8_t *>(std::malloc(bytes));
    if (!*out) return fail(PEBBLE_ERR_HOST_OOM, "pebble_decoder_create: no memory for %" PRIu64 " bytes of scratch", bytes);
#else
    void * p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError();
        return fail(PEBBLE_ERR_DEVICE_OOM, "pebble_decoder_create: no device memory for %" PRIu64 " bytes of scratch",
                    bytes);
    }
    *out = static_cast<uint8_t *>(p);
#endif
    return PEBBLE_OK;
}

void free_scratch(uint8_t * p) {
#ifdef PEBBLE_HOST_BUILD
    std::free(p);
#else
    if (p) cudaFree(p);
#endif
}

} // namespace pebble_internal

namespace {

pebble_status check_shape(const pebble_layer_shape * s, int64_t n_ctx) {
    if (!s) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "shape must not be NULL");
    if (s->n_embd < 1 || s->n_head < 1 || s->n_head_kv < 1 || s->head_dim < 1 || s->n_ff < 1 || n_ctx < 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "n_embd %d, n_head %d, n_head_kv %d, head_dim %d, "
                    "n_ff %d and n_ctx %" PRId64 " must each be at least 1", s->n_embd, s->n_head, s->n_head_kv,
                    s->head_dim, s->n_ff, n_ctx);
    }
    if (s->n_head % s->n_head_kv != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%d query heads cannot share %d KV heads evenly",
                    s->n_head, s->n_head_kv);
    }
    if (s->rope_dims < 0 || s->rope_dims > s->head_dim || s->rope_dims % 2 != 0) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "rope_dims %d must be even and within 0..head_dim "
                    "(%d)", s->rope_dims, s->head_dim);
    }
    if (s->activation < 0 || s->activation > 2 || (s->activation == 2 && s->n_expert < 1)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "activation is %d; 0 (SwiGLU), 1 (GELU) or, in a layer of experts, 2 "
                    "(gpt-oss's clamped SwiGLU) are accepted", s->activation);
    }
    if (s->ring != 0 && s->ring != 1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "ring is %d; 0 or 1 are accepted", s->ring);
    }
    if (!(s->attn_softcap >= 0.0f) || !std::isfinite(s->attn_softcap) || !std::isfinite(s->residual_scale)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "attn_softcap %g must be finite and at least 0, "
                    "residual_scale %g finite", static_cast<double>(s->attn_softcap),
                    static_cast<double>(s->residual_scale));
    }
    if ((s->v_norm != 0 && s->v_norm != 1) || s->kv_layer < -1) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "v_norm is %d and kv_layer %d; v_norm 0 or 1, kv_layer -1 (caches of "
                    "its own) or an earlier layer's index are accepted", s->v_norm, s->kv_layer);
    }
    if (n_ctx > INT64_MAX / 4 / s->n_head) {
        return fail(PEBBLE_ERR_SIZE_MISMATCH, "n_ctx %" PRId64 " is too large", n_ctx);
    }
    if (s->n_expert < 0 || s->n_expert > max_experts || s->n_ff_shexp < 0 ||
        (s->n_expert > 0 && (s->n_expert_used < 1 || s->n_expert_used > std::min(s->n_expert, max_experts_used) ||
                             s->n_ff_exp < 1 ||
                             (s->expert_norm != 0 && s->expert_norm != 1) || !std::isfinite(s->expert_scale) ||
                             (s->expert_gating != 0 && s->expert_gating != 1) ||
                             (s->expert_gating == 1 && s->expert_norm))) ||
        (s->n_expert == 0 && s->expert_gating != 0)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "experts: n_expert %d must be within 0..%d and, above 0, "
                    "n_expert_used %d within 1..n_expert (and %d), n_ff_exp %d at least 1, expert_norm %d 0 or 1, "
                    "expert_scale %g finite, activation %d 0, 1 or 2, expert_gating %d 0 or 1 (1 with "
                    "expert_norm 0; 0 without experts); n_ff_shexp %d at least 0", s->n_expert, max_experts,
                    s->n_expert_used, max_experts_used, s->n_ff_exp, s->expert_norm,
                    static_cast<double>(s->expert_scale), s->activation, s->expert_gating, s->n_ff_shexp);
    }
    return PEBBLE_OK;
}

pebble_status check_vector(const char * what, const pebble_tensor_ref & t, bool optional) {
    if (!t.data) {
        return optional ? PEBBLE_OK
                        : fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s must not be NULL", what);
    }
    if (t.ggml_type != f32_type && t.ggml_type != f16_type) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s has GGUF type %d (%s); vectors must be "
                    "0 F32 or 1 F16", what, t.ggml_type, ggml_type_name(t.ggml_type));
    }
    return PEBBLE_OK;
}

pebble_status check_weight(const char * what, const pebble_tensor_ref & t, int64_t rows, int64_t cols) {
    if (!t.data) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s must not be NULL", what);
    return check_matrix("weight", what, t.ggml_type, rows, cols);
}

// Gemma 4's parts of layer i: a reader of another's caches gives no K or V weights; V = K only with V's norm;
// the per-layer embedding's three weights together, of the model's width, and the output scale a vector of 1.
pebble_status check_gemma4(const char * where, const pebble_layer_shape & s, const pebble_layer_weights & w,
                           int32_t n_pl) {
    const bool reader = s.kv_layer >= 0;
    if (reader && (w.wk.data || w.wv.data || w.bk.data || w.bv.data || w.k_norm.data)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: the layer reads layer %d's caches (kv_layer), so it computes no "
                    "K or V: wk, wv, bk, bv and k_norm must be NULL", where, s.kv_layer);
    }
    if (!reader && !w.wv.data && (!s.v_norm || w.bv.data)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: wv must not be NULL; V is K's projection (wv NULL) only where V "
                    "is normed (v_norm 1) and has no bias", where);
    }
    const int given = !!w.per_layer_inp_gate.data + !!w.per_layer_proj.data + !!w.per_layer_post_norm.data;
    if ((given != 0 && given != 3) || (given && n_pl < 1)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: per_layer_inp_gate, per_layer_proj and per_layer_post_norm go "
                    "together (%d of 3 given), with the model's n_embd_per_layer above 0 (it is %d)", where, given, n_pl);
    }
    pebble_status st = PEBBLE_OK;
    if (given && ((st = check_weight("per_layer_inp_gate", w.per_layer_inp_gate, n_pl, s.n_embd)) != PEBBLE_OK ||
                  (st = check_weight("per_layer_proj", w.per_layer_proj, s.n_embd, n_pl)) != PEBBLE_OK ||
                  (st = check_vector("per_layer_post_norm", w.per_layer_post_norm, false)) != PEBBLE_OK)) {
        return with_place(st, where);
    }
    if ((st = check_vector("out_scale", w.out_scale, true)) != PEBBLE_OK) return with_place(st, where);
    // The 26B-A4B's layer: experts beside a dense FFN (w_gate given with n_expert > 0) take the router's scale and
    // the three norms, the experts' scales optional; any of them elsewhere is refused.
    const bool beside = s.n_expert > 0 && w.w_gate.data;
    const struct { const char * name; const pebble_tensor_ref & t; bool optional; } moe_only[] = {
        {"ffn_gate_inp_s", w.ffn_gate_inp_s, false}, {"ffn_pre_norm_2", w.ffn_pre_norm_2, false},
        {"ffn_post_norm_1", w.ffn_post_norm_1, false}, {"ffn_post_norm_2", w.ffn_post_norm_2, false},
        {"ffn_down_exps_s", w.ffn_down_exps_s, true}};
    for (const auto & v : moe_only) {
        if (!beside && v.t.data) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s is given, but the layer has no dense FFN beside experts "
                        "(w_gate with n_expert above 0; it has n_expert %d), the only layer that reads it", where,
                        v.name, s.n_expert);
        }
        if (beside && !v.optional && !v.t.data) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s must not be NULL: a dense FFN beside experts (Gemma 4's) "
                        "needs ffn_gate_inp_s, ffn_pre_norm_2, ffn_post_norm_1 and ffn_post_norm_2 (ffn_down_exps_s "
                        "optional)", where, v.name);
        }
        if (beside && (st = check_vector(v.name, v.t, true)) != PEBBLE_OK) return with_place(st, where);
    }
    return PEBBLE_OK;
}

pebble_status check_layer(const char * fn, int32_t i, const pebble_layer_shape & s, const pebble_layer_weights & w,
                          int64_t kv_rows, bool experts_stored, int32_t n_pl) {
    // Which layer failed is added to the message of the layer's own checks here.
    char where[64];
    snprintf(where, sizeof where, "%s: layer %d", fn, i);
    pebble_status st = check_shape(&s, kv_rows);
    if (st != PEBBLE_OK) return with_place(st, where);
    const int64_t e = s.n_embd, q = int64_t(s.n_head) * s.head_dim, kv = int64_t(s.n_head_kv) * s.head_dim;
    const struct { const char * name; const pebble_tensor_ref & t; bool optional; } vectors[] = {
        {"attn_norm", w.attn_norm, false}, {"ffn_norm", w.ffn_norm, false}, {"bq", w.bq, true}, {"bk", w.bk, true},
        {"bv", w.bv, true}, {"q_norm", w.q_norm, true}, {"k_norm", w.k_norm, true},
        {"post_attn_norm", w.post_attn_norm, true}, {"post_ffn_norm", w.post_ffn_norm, true}};
    for (const auto & vec : vectors) {
        if ((st = check_vector(vec.name, vec.t, vec.optional)) != PEBBLE_OK) {
            return with_place(st, where);
        }
    }
    if ((st = check_gemma4(where, s, w, n_pl)) != PEBBLE_OK) return st;
    if ((w.q_norm.data || w.k_norm.data) && (w.bq.data || w.bk.data)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: Q/K norms together with Q/K biases are not supported", where);
    }
    const int64_t E = s.n_expert, ff = s.n_expert ? s.n_ff_exp : s.n_ff, sh = s.n_ff_shexp, nf = s.n_ff;
    const bool moe = E > 0, shared = moe && sh > 0;
    const bool dense = !moe || w.w_gate.data;  // Gemma 4's layer of experts has a dense FFN beside them
    const struct { const char * name; const pebble_tensor_ref & t; int64_t rows, cols; bool wanted; } matrices[] = {
        {"wq", w.wq, q, e, true}, {"wk", w.wk, kv, e, s.kv_layer < 0}, {"wv", w.wv, kv, e, s.kv_layer < 0 && !!w.wv.data},
        {"wo", w.wo, e, q, true},
        {"w_gate", w.w_gate, nf, e, dense}, {"w_up", w.w_up, nf, e, dense}, {"w_down", w.w_down, e, nf, dense},
        {"ffn_gate_inp", w.ffn_gate_inp, E, e, moe}, {"ffn_gate_exps", w.ffn_gate_exps, E * ff, e, moe},
        {"ffn_up_exps", w.ffn_up_exps, E * ff, e, moe}, {"ffn_down_exps", w.ffn_down_exps, E * e, ff, moe},
        {"ffn_gate_shexp", w.ffn_gate_shexp, sh, e, shared}, {"ffn_up_shexp", w.ffn_up_shexp, sh, e, shared},
        {"ffn_down_shexp", w.ffn_down_shexp, e, sh, shared}};
    for (const auto & m : matrices) {
        if (!m.wanted && m.t.data) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %s is given but the shape (n_expert %d, n_ff_shexp %d) has "
                        "no use for it", where, m.name, s.n_expert, s.n_ff_shexp);
        }
        const bool stored = experts_stored && (&m.t == &w.ffn_gate_exps || &m.t == &w.ffn_up_exps ||
                                               &m.t == &w.ffn_down_exps);  // entries of the store: types only
        if (m.wanted && (st = stored ? check_matrix("weight", m.name, m.t.ggml_type, m.rows, m.cols)
                                     : check_weight(m.name, m.t, m.rows, m.cols)) != PEBBLE_OK) {
            return with_place(st, where);
        }
    }
    if ((st = check_vector("ffn_gate_inp_shexp", w.ffn_gate_inp_shexp, !shared)) != PEBBLE_OK) {
        return with_place(st, where);
    }
    if (!shared && w.ffn_gate_inp_shexp.data) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: ffn_gate_inp_shexp is given but the layer has no shared "
                    "expert (n_ff_shexp %d)", where, s.n_ff_shexp);
    }
    // gpt-oss's: the sinks F32 (the attention reads them as floats), the biases vectors; the experts' three
    // biases together or not at all, and only in a layer of experts
    const bool expert_biases = w.ffn_gate_exps_b.data || w.ffn_up_exps_b.data || w.ffn_down_exps_b.data;
    if ((w.attn_sinks.data && w.attn_sinks.ggml_type != f32_type) ||
        (!moe && (w.ffn_gate_inp_b.data || expert_biases)) ||
        (expert_biases && !(w.ffn_gate_exps_b.data && w.ffn_up_exps_b.data && w.ffn_down_exps_b.data))) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: attn_sinks must be 0 F32 where given; ffn_gate_inp_b and the "
                    "experts' biases (ffn_gate_exps_b, ffn_up_exps_b, ffn_down_exps_b, all three or none) are for a "
                    "layer of experts", where);
    }
    const struct { const char * name; const pebble_tensor_ref & t; } biases[] = {
        {"bo", w.bo}, {"ffn_gate_inp_b", w.ffn_gate_inp_b}, {"ffn_gate_exps_b", w.ffn_gate_exps_b},
        {"ffn_up_exps_b", w.ffn_up_exps_b}, {"ffn_down_exps_b", w.ffn_down_exps_b}};
    for (const auto & b : biases) {
        if ((st = check_vector(b.name, b.t, true)) != PEBBLE_OK) return with_place(st, where);
    }
    return PEBBLE_OK;
}

// Handles are ids, never reused, so that a freed decoder is detected rather than dereferenced.
std::mutex                                                    g_decoders_mu;
std::unordered_map<uintptr_t, std::shared_ptr<pebble_decoder>> g_decoders;
uintptr_t                                                     g_next_decoder = 1;

std::shared_ptr<pebble_decoder> find_decoder(pebble_decoder_t handle) {
    std::lock_guard<std::mutex> hold(g_decoders_mu);
    auto it = g_decoders.find(reinterpret_cast<uintptr_t>(handle));
    return it == g_decoders.end() ? nullptr : it->second;
}

pebble_status closed(const char * fn) { return fail(PEBBLE_ERR_CLOSED, "%s: the decoder was freed or never made", fn); }

// What a decoder holds beside its description: scratch, graphs and, on the GPU, its stream, events and
// pinned positions (its last step finished first).
void release_device(pebble_decoder & d) {
#ifndef PEBBLE_HOST_BUILD
    if (d.done) cudaEventSynchronize(d.done);
    if (d.copy) cudaStreamSynchronize(d.copy);
#endif
    d.graphs.give_up();
#ifndef PEBBLE_HOST_BUILD
    if (d.ready) cudaEventDestroy(d.ready);
    if (d.done) cudaEventDestroy(d.done);
    if (d.own) cudaStreamDestroy(d.own);
    if (d.pos_host) cudaFreeHost(d.pos_host);
    d.ready = d.done = nullptr;
    d.own = nullptr;
    d.pos_host = nullptr;
#endif
    free_scratch(d.scratch);
    d.scratch = nullptr;
    free_scratch(d.expert_buffer);
    d.expert_buffer = nullptr;
    for (uint8_t *& slot : d.slots) {
        free_scratch(slot);
        slot = nullptr;
    }
#ifndef PEBBLE_HOST_BUILD
    for (int k = 0; k < 2; k++) {
        if (d.slot_ready[k]) cudaEventDestroy(d.slot_ready[k]);
        if (d.slot_free[k]) cudaEventDestroy(d.slot_free[k]);
        d.slot_ready[k] = d.slot_free[k] = nullptr;
    }
    if (d.copied) cudaEventDestroy(d.copied);
    if (d.copy) cudaStreamDestroy(d.copy);
    d.copied = nullptr;
    d.copy = nullptr;
#endif
}

} // namespace

extern "C" pebble_status pebble_decoder_create(const pebble_step_model * model, const pebble_step_layer * layers,
                                               void * const * k_caches, void * const * v_caches, pebble_decoder_t * out) {
    const char * fn = "pebble_decoder_create";
    if (!model || !layers || !k_caches || !v_caches || !out) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: model, layers, k_caches, v_caches and out must not be NULL", fn);
    }
    *out = nullptr;
    const pebble_step_model & m = *model;
    if (m.n_layer < 1 || m.n_embd < 1 || m.n_vocab < 1 || m.n_seq < 1 || m.n_seq > PEBBLE_DECODER_MAX_BATCH) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: n_layer %d, n_embd %d and n_vocab %d must each be at least 1, "
                    "n_seq %d within 1..%d", fn, m.n_layer, m.n_embd, m.n_vocab, m.n_seq, PEBBLE_DECODER_MAX_BATCH);
    }
    if (!kv_known(m.kv_type)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: kv_type %d (%s); the caches must be 0 F32, 1 F16, 8 Q8_0 or 2 Q4_0",
                    fn, m.kv_type, ggml_type_name(m.kv_type));
    }
    if (m.n_embd_per_layer < 0 || int64_t(m.n_embd_per_layer) * m.n_layer > (int64_t(1) << 40)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: n_embd_per_layer %d must be 0 (none) or more, and n_layer times "
                    "it addressable", fn, m.n_embd_per_layer);
    }
    if (!std::isfinite(m.logit_scale) || !(m.final_softcap >= 0.0f) || !std::isfinite(m.final_softcap)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: logit_scale %g must be finite, final_softcap %g finite and at "
                    "least 0", fn, static_cast<double>(m.logit_scale), static_cast<double>(m.final_softcap));
    }
    pebble_status st = check_vector("output_norm", m.output_norm, false);
    if (st == PEBBLE_OK) st = check_weight("output", m.output, m.n_vocab, m.n_embd);
    if (st != PEBBLE_OK) return with_place(st, fn);
    auto d = std::make_shared<pebble_decoder>();
    d->model = m;
    d->layers.assign(layers, layers + m.n_layer);
    const size_t n_caches = size_t(m.n_layer) * size_t(m.n_seq);
    d->k.assign(k_caches, k_caches + n_caches);
    d->v.assign(v_caches, v_caches + n_caches);
    d->stream_order.assign(size_t(m.n_layer), -1);
    d->weight_bytes.assign(size_t(m.n_layer), {});
    for (int32_t i = 0; i < m.n_layer; i++) {
        if (layers[i].streamed) TRY(describe_streamed(*d, fn, i));
    }
    for (int32_t i = 0; i < m.n_layer; i++) {
        const pebble_step_layer & L = d->layers[size_t(i)];
        TRY(check_layer(fn, i, L.shape, L.weights, L.kv_rows, L.experts_stored != 0, m.n_embd_per_layer));
        const int32_t src = L.shape.kv_layer;
        if (src >= 0) { // Gemma 4: attends over an earlier layer's caches, which that layer keeps resident
            const pebble_step_layer * S = src < i ? &d->layers[size_t(src)] : nullptr;
            if (!S || S->shape.kv_layer >= 0 || S->streamed || S->shape.n_head_kv != L.shape.n_head_kv ||
                S->shape.head_dim != L.shape.head_dim || S->shape.ring != L.shape.ring || S->kv_rows != L.kv_rows) {
                return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d reads layer %d's caches (kv_layer): that must be "
                            "an earlier layer with caches of its own, not streamed, of the same n_head_kv, head_dim, "
                            "ring and kv_rows", fn, i, src);
            }
        }
        if (L.shape.n_embd != m.n_embd) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d is %d wide; the model is %d", fn, i, L.shape.n_embd,
                        m.n_embd);
        }
        if (!L.rope_cos || !L.rope_sin || L.rope_rows < 1) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: rope_cos and rope_sin must not be NULL, rope_rows "
                        "(%" PRId64 ") at least 1", fn, i, L.rope_rows);
        }
        const int64_t kv_row = int64_t(L.shape.n_head_kv) * L.shape.head_dim;  // a cache row's elements
        if (L.kv_rows > INT64_MAX / 4 / m.n_seq / std::max<int64_t>(L.shape.n_head, kv_row) ||
            L.rope_rows > INT64_MAX / 4 / L.shape.head_dim) {
            return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %d: kv_rows %" PRId64 " or rope_rows %" PRId64 " is too "
                        "large to address", fn, i, L.kv_rows, L.rope_rows);
        }
        if (kv_blocked(m.kv_type) && L.shape.head_dim % kv_block != 0) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: head_dim %d is not a multiple of %d, which %s "
                        "caches need", fn, i, L.shape.head_dim, kv_block, ggml_type_name(m.kv_type));
        }
        if (!std::isfinite(L.attn_scale)) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: attn_scale %g must be finite", fn, i,
                        static_cast<double>(L.attn_scale));
        }
        for (int32_t s = 0; s < m.n_seq && !L.streamed && L.shape.kv_layer < 0; s++) { // a reader's are not read
            if (!d->k[size_t(i) * m.n_seq + s] || !d->v[size_t(i) * m.n_seq + s]) {
                return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %d: sequence %d has a NULL cache", fn, i, s);
            }
        }
        const int64_t q = int64_t(L.shape.n_head) * L.shape.head_dim, kv = int64_t(L.shape.n_head_kv) * L.shape.head_dim;
        d->widest = std::max<int64_t>({d->widest, L.shape.n_embd, q, L.shape.n_ff, m.n_embd_per_layer});
        d->max_q = std::max(d->max_q, q);
        d->max_kv = std::max(d->max_kv, kv);
        d->max_ff = std::max<int64_t>({d->max_ff, L.shape.n_ff, L.shape.n_expert ? L.shape.n_ff_exp : 0,
                                       L.shape.n_expert ? L.shape.n_ff_shexp : 0, m.n_embd_per_layer});
        d->max_expert = std::max<int64_t>(d->max_expert, L.shape.n_expert);
        d->max_heads = std::max<int64_t>(d->max_heads, L.shape.n_head);
        d->max_rows = std::max(d->max_rows, L.kv_rows);
    }
#ifndef PEBBLE_HOST_BUILD
    for (size_t c = 0; c < n_caches; c++) {
        const pebble_step_layer & L = d->layers[c / size_t(m.n_seq)];
        if (L.streamed || L.shape.kv_layer >= 0) continue; // a slot's, placed below; or not read (its source's)
        TRY(check_device_pointer(d->k[c], "a K cache", fn));
        TRY(check_device_pointer(d->v[c], "a V cache", fn));
    }
#endif
    const uint64_t B = uint64_t(m.n_seq);
    uint64_t at = 0;
    auto take = [&at](uint64_t bytes) { const uint64_t here = at; at += aligned(bytes); return here; };
    step_scratch & l = d->at;
    l.h16 = take(sizeof(act_t) * B * uint64_t(std::max<int64_t>(d->widest, m.n_embd)));
    l.q = take(4 * B * uint64_t(d->max_q));
    l.k = take(4 * B * uint64_t(d->max_kv));
    l.v = take(4 * B * uint64_t(d->max_kv));
    l.q_rot = take(4 * B * uint64_t(d->max_q));
    l.kv_new = take(4 * 2 * B * uint64_t(d->max_kv));  // the new K and V rows before they are stored
    l.scores = take(4 * B * uint64_t(d->max_heads) * uint64_t(d->max_rows));
    // each layer's n_head x parts x head_dim sums and n_head x parts x 2 (largest score, sum of exps) fit
    d->parts_per_seq = (d->max_q + 2 * d->max_heads) * split_parts(d->max_rows);
    l.parts = take(4 * B * uint64_t(d->parts_per_seq));
    l.o = take(4 * B * uint64_t(m.n_embd));
    l.gate = take(4 * B * uint64_t(d->max_ff));
    l.up = take(4 * B * uint64_t(d->max_ff));
    l.pos = take(8 * B);
    if (d->max_expert) {
        l.router = take(4 * B * uint64_t(d->max_expert));
        l.rows = take(sizeof(act_t) * B * uint64_t(m.n_embd));
        l.act = take(sizeof(act_t) * B * uint64_t(d->max_ff));
        l.y = take(4 * B * uint64_t(m.n_embd));
        d->router_host.assign(size_t(B) * size_t(d->max_expert), 0.0f);
        d->exps_scale_host.assign(size_t(d->max_expert), 0.0f);
        d->router_p.assign(size_t(d->max_expert), 0.0f);
        d->router_order.assign(size_t(d->max_expert), 0);
    }
#ifndef PEBBLE_HOST_BUILD
    // x (with the per-layer inputs after it) and the logits in and out of fixed addresses (a graph's)
    l.x = take(4 * B * (uint64_t(m.n_embd) + uint64_t(m.n_layer) * uint64_t(m.n_embd_per_layer)));
    l.logits = take(4 * B * uint64_t(m.n_vocab));
#endif
    l.bytes = at;
    // The store's copies are not captured, nor is a step whose launches follow its router's choice.
    d->graphs.enabled = m.graphs != 0 && d->streamed.empty() && d->max_expert == 0;
    TRY(alloc_scratch(&d->scratch, l.bytes));
    d->stats.scratch_bytes = l.bytes;
    pebble_status placed = place_experts(*d, fn);
    if (placed != PEBBLE_OK) {
        release_device(*d);
        return placed;
    }
    if (!d->streamed.empty()) {
        pebble_status st = place_streamed(*d, fn);
        if (st != PEBBLE_OK) {
            release_device(*d);
            return st;
        }
    }
#ifndef PEBBLE_HOST_BUILD
    if (cudaHostAlloc(reinterpret_cast<void **>(&d->pos_host), 8 * B, cudaHostAllocPortable) != cudaSuccess ||
        cudaStreamCreateWithFlags(&d->own, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&d->ready, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&d->done, cudaEventDisableTiming) != cudaSuccess) {
        const cudaError_t err = cudaGetLastError();
        release_device(*d);
        return fail(PEBBLE_ERR_CUDA, "%s: the decoder's stream, events or pinned positions could not be made: %s", fn,
                    cudaGetErrorString(err));
    }
#endif
    std::lock_guard<std::mutex> hold(g_decoders_mu);
    const uintptr_t id = g_next_decoder++;
    g_decoders.emplace(id, std::move(d));
    *out = reinterpret_cast<pebble_decoder_t>(id);
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_decoder_step(pebble_decoder_t handle, int32_t n, const int32_t * seqs, const int64_t * pos,
                                             float * x, float * logits, void * stream_ptr) {
    const char * fn = "pebble_decoder_step";
    const std::shared_ptr<pebble_decoder> d = find_decoder(handle);
    if (!d) return closed(fn);
    std::lock_guard<std::mutex> hold(d->lock);
    const pebble_step_model & m = d->model;
    if (n < 1 || n > m.n_seq) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: %d tokens; the decoder holds 1..%d sequences", fn, n, m.n_seq);
    }
    if (!seqs || !pos || !x) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: seqs, pos and x must not be NULL", fn);
    uint64_t seen = 0;
    for (int32_t b = 0; b < n; b++) {
        if (seqs[b] < 0 || seqs[b] >= m.n_seq || (seen >> seqs[b] & 1)) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: token %d is of sequence %d; each of 0..%d at most once a step",
                        fn, b, seqs[b], m.n_seq - 1);
        }
        seen |= uint64_t(1) << seqs[b];
        for (int32_t i = 0; i < m.n_layer; i++) {
            const pebble_step_layer & L = d->layers[size_t(i)];
            if (pos[b] < 0 || pos[b] >= L.rope_rows || (pos[b] >= L.kv_rows && !L.shape.ring)) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: sequence %d at position %" PRId64 " is outside layer %d's "
                            "0..%" PRId64, fn, seqs[b], pos[b], i, std::min(L.rope_rows, L.shape.ring ? INT64_MAX : L.kv_rows) - 1);
            }
        }
    }
#ifndef PEBBLE_HOST_BUILD
    TRY(check_device_pointer(x, "x", fn));
    if (logits) TRY(check_device_pointer(logits, "logits", fn));
#endif
    step_key key;
    key.n = n;
    key.logits = logits != nullptr;
    std::copy(seqs, seqs + n, key.seqs);
    int slot = 0;
    const step_mode mode = d->graphs.decide(key, &slot);
#ifdef PEBBLE_HOST_BUILD
    (void)stream_ptr;
    std::memcpy(at_offset<int64_t>(d->scratch, d->at.pos), pos, sizeof(int64_t) * size_t(n));
    TRY(enqueue_step(*d, n, seqs, pos, x, logits, nullptr));
    if (mode == step_mode::capture) d->graphs.keep(slot, key);
#else
    TRY(run_on_device(*d, mode, slot, key, pos, x, logits, static_cast<cudaStream_t>(stream_ptr)));
#endif
    d->stats.steps++;
    d->stats.tokens += uint64_t(n);
    d->stats.layer_passes += uint64_t(m.n_layer);
    d->stats.graphs_captured = d->graphs.captured;
    d->stats.graph_replays = d->graphs.replays;
    d->stats.graphs_dropped = d->graphs.dropped;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_decoder_stats(pebble_decoder_t handle, struct pebble_decoder_stats * out) {
    const std::shared_ptr<pebble_decoder> d = find_decoder(handle);
    if (!d) return closed("pebble_decoder_stats");
    if (!out) return fail(PEBBLE_ERR_INVALID_ARGUMENT, "pebble_decoder_stats: out must not be NULL");
    std::lock_guard<std::mutex> hold(d->lock);
    *out = d->stats;
    return PEBBLE_OK;
}

extern "C" pebble_status pebble_decoder_free(pebble_decoder_t handle) {
    if (!handle) return PEBBLE_OK;
    std::shared_ptr<pebble_decoder> d;
    {
        std::lock_guard<std::mutex> hold(g_decoders_mu);
        auto it = g_decoders.find(reinterpret_cast<uintptr_t>(handle));
        if (it == g_decoders.end()) return closed("pebble_decoder_free");
        d = std::move(it->second);
        g_decoders.erase(it);
    }
    std::lock_guard<std::mutex> hold(d->lock); // a step in flight on another thread ends first
    release_device(*d);
    return PEBBLE_OK;
}

// cuda/experts.cu: a decode step's layers of experts (qwen2moe, qwen3moe, mixtral-style, gpt-oss, Gemma 4's
// 26B-A4B): the router's scores (its bias added where given; Gemma 4's of an input of its own) read back to the
// host, which chooses each token's n_expert_used experts (a softmax over all, the most probable, weights
// normalised where asked; or gpt-oss's highest scores and a softmax over them); then expert by expert the
// tokens routed to it gathered and run through its gate, up and down matrices (SwiGLU, GELU or gpt-oss's
// clamped form, its biases where given; its rows read once for them all) and added, weighted (times a scale of
// its own where given), to their tokens' output; the shared expert after, gated by a sigmoid where the layer
// has one.
// An expert's matrices come from the layer's merged tensors, or from a store as pebbles, through a per-layer
// cache of slots (least recently or least often used) and staging slots, guessed and restored early where
// asked (prefetch_experts: those restores are on the step's stream, so on the GPU they do not yet overlap
// compute).

#include "cuda/decoder.cuh"
#include "cuda/ops.cuh"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

using namespace pebble_internal;

namespace {

// out[r] = 0 for r < n
__global__ void zero_kernel(float * __restrict__ out, int64_t n) {
    for (int64_t i = grid_thread(); i < n; i += grid_threads()) out[i] = 0.0f;
}

// One warp per token: out[b] += y[b] * sigmoid(h[b] . g) (the shared expert's gate, qwen2moe).
__global__ void shared_gate_kernel(float * __restrict__ out, const float * __restrict__ y, const act_t * __restrict__ h,
                                   int64_t n_rows, int64_t e, const void * g, int32_t g_type) {
    for (int64_t r = grid_warp(); r < n_rows; r += grid_warps()) {
        float dot = 0.0f;
        for (int64_t i = warp_lane(); i < e; i += warp_lanes) dot += act_value(h, r * e + i) * load_value(g, g_type, i);
        dot = warp_sum(dot);
        const float gate = 1.0f / (1.0f + expf(-dot));
        for (int64_t i = warp_lane(); i < e; i += warp_lanes) out[r * e + i] += y[r * e + i] * gate;
    }
}

uint64_t row_bytes(int32_t type, int64_t cols) {
    int64_t elements = 1, block = 0;
    type_block(type, &elements, &block);
    return uint64_t(cols / elements) * uint64_t(block);
}

pebble_store_t expert_store(const pebble_decoder & d) {
    return d.model.expert_store ? d.model.expert_store : d.model.store;
}

// The victim of layer i's cache (it has slots): an empty slot, else among the experts the step does not
// still have to run (all of them where it has to run every one) the least recently used, or with
// expert_policy 1 the least often run (ties to the least recently used).
size_t cache_victim(const pebble_decoder & d, const pebble_decoder::expert_cache & c) {
    size_t victim = 0;
    for (size_t k = 0; k < c.expert.size(); k++) {
        if (c.expert[k] < 0) return k;
        const bool needed = d.to_run[size_t(c.expert[k])] != 0, victim_needed = d.to_run[size_t(c.expert[victim])] != 0;
        if (needed != victim_needed) {
            if (!needed) victim = k;
            continue;
        }
        const uint64_t uk = c.uses[size_t(c.expert[k])], uv = c.uses[size_t(c.expert[victim])];
        const bool older = c.used[k] < c.used[victim];
        if (d.model.expert_policy == 1 ? (uk < uv || (uk == uv && older)) : older) victim = k;
    }
    return victim;
}

// A staging slot for a miss of layer i, which has no cache: a free one, else one holding a guess the layer
// does not run, else the guess still to run of the highest expert index.
size_t staging_victim(const pebble_decoder & d, int32_t i) {
    size_t pick = 0;
    int32_t pick_expert = -1;
    for (size_t k = 0; k < d.staging.size(); k++) {
        const pebble_decoder::staged & g = d.staging[k];
        if (g.layer != i || !d.to_run[size_t(g.expert)]) return k;
        if (g.expert > pick_expert) {
            pick = k;
            pick_expert = g.expert;
        }
    }
    return pick;
}

pebble_status restore_expert(pebble_decoder & d, int32_t i, int32_t j, uint8_t * slot, cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_decoder::expert_cache & c = d.experts[size_t(i)];
    const uint64_t nbytes = c.nbytes;
    pebble_status st = PEBBLE_OK;
    if (L.experts_stored == 2) { // the j-th n_expert-th of each merged tensor, one after another
        uint64_t at = 0;
        for (int m = 0; m < 3 && st == PEBBLE_OK; at += c.part_bytes[m], m++) {
            st = pebble_read(d.model.store, i, L.weight_ids[merged_expert_fields[m]], uint64_t(j) * c.part_bytes[m],
                             slot + at, c.part_bytes[m], stream);
        }
    } else {
        st = pebble_restore(expert_store(d), i, L.expert_ids + j, slot, nbytes, stream);
    }
    if (st != PEBBLE_OK) {
        char where[96];
        snprintf(where, sizeof where, "pebble_decoder_step: layer %d: expert %d", i, j);
        return with_place(st, where);
    }
    d.stats.expert_bytes_restored += nbytes;
    return PEBBLE_OK;
}

// Expert j of layer i where the step runs it: a hit where the layer's cache holds it or a guess brought it
// to a staging slot (taken into the cache, where the layer has one), else restored (on `stream`, so after
// whatever read the slot before) into the cache's victim or a staging slot.
pebble_status cached_expert(pebble_decoder & d, int32_t i, int32_t j, cudaStream_t stream, uint8_t ** out) {
    pebble_decoder::expert_cache & c = d.experts[size_t(i)];
    const uint64_t now = ++d.expert_clock;
    c.uses[size_t(j)]++;
    d.to_run[size_t(j)] = 0;
    for (size_t k = 0; k < c.expert.size(); k++) {
        if (c.expert[k] == j) {
            c.used[k] = now;
            d.stats.expert_hits++;
            *out = c.slot[k];
            return PEBBLE_OK;
        }
    }
    for (pebble_decoder::staged & g : d.staging) {
        if (g.layer != i || g.expert != j) continue;
        d.stats.expert_hits++;
        d.stats.expert_prefetch_hits++;
        g.layer = g.expert = -1;
        if (c.slot.empty()) {
            *out = g.slot;  // free again: the next restore into it is ordered after this expert's FFN
            return PEBBLE_OK;
        }
        const size_t v = cache_victim(d, c);
        std::swap(c.slot[v], g.slot);
        c.expert[v] = j;
        c.used[v] = now;
        *out = c.slot[v];
        return PEBBLE_OK;
    }
    uint8_t * slot;
    if (c.slot.empty()) {
        pebble_decoder::staged & g = d.staging[staging_victim(d, i)];
        g.layer = g.expert = -1;
        slot = g.slot;
    } else {
        const size_t v = cache_victim(d, c);
        c.expert[v] = -1;
        slot = c.slot[v];
        TRY(restore_expert(d, i, j, slot, stream));
        c.expert[v] = j;
        c.used[v] = now;
        d.stats.expert_misses++;
        *out = slot;
        return PEBBLE_OK;
    }
    TRY(restore_expert(d, i, j, slot, stream));
    d.stats.expert_misses++;
    *out = slot;
    return PEBBLE_OK;
}

// What layer L's router scores for the n rows of x [n][n_embd], into out: x RMS-normed with the layer's ffn_norm;
// or, where the layer has a dense FFN beside its experts (Gemma 4's, ffn_gate_inp_s given), x normed without a
// weight, times ffn_gate_inp_s over sqrt(n_embd).
pebble_status router_input(const pebble_step_layer & L, const float * x, int32_t n, act_t * out, cudaStream_t stream) {
    const pebble_layer_shape & s = L.shape;
    if (L.weights.ffn_gate_inp_s.data) {
        const float sqrt_e = sqrtf(static_cast<float>(s.n_embd));
        return scaled_norm_rows(x, n, s.n_embd, L.weights.ffn_gate_inp_s, sqrt_e, s.rms_eps, out, stream);
    }
    return norm_rows(x, n, s.n_embd, L.weights.ffn_norm, s.rms_eps, out, stream);
}

} // namespace

namespace pebble_internal {

// Prefetch for layer i (pebble_step_model.expert_prefetch): its router applied to x [n][n_embd], the hidden
// state entering it, as router_input prepares it (before the layer's attention has added to it: a guess); the
// n_expert_used experts of the highest probability summed over the n tokens guessed, and each one the layer's
// cache lacks restored into a staging slot.
pebble_status prefetch_experts(pebble_decoder & d, int32_t i, int32_t n, const float * x, cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(i)];
    const pebble_layer_shape & s = L.shape;
    const int64_t e = s.n_embd, E = s.n_expert;
    act_t * h16 = at_offset<act_t>(d.scratch, d.at.h16);
    float * router = at_offset<float>(d.scratch, d.at.router);
    TRY(router_input(L, x, n, h16, stream));
    TRY(matvec_many(L.weights.ffn_gate_inp.ggml_type, L.weights.ffn_gate_inp.data, E, e, h16, n, router, stream));
    if (L.weights.ffn_gate_inp_b.data) TRY(add_bias(router, n, E, L.weights.ffn_gate_inp_b, 0, stream));
    CUDA_CHECK(cudaMemcpyAsync(d.router_host.data(), router, sizeof(float) * size_t(n) * size_t(E), cudaMemcpyDefault,
                               stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> & score = d.guess_score;
    std::vector<int32_t> & order = d.router_order;
    std::fill(score.begin(), score.begin() + E, 0.0f);
    for (int32_t b = 0; b < n; b++) {
        const float * sc = d.router_host.data() + size_t(b) * size_t(E);
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < E; j++) top = std::max(top, sc[j]);
        for (int64_t j = 0; j < E; j++) total += expf(sc[j] - top);
        for (int64_t j = 0; j < E; j++) score[size_t(j)] += expf(sc[j] - top) / total;
    }
    for (int64_t j = 0; j < E; j++) order[size_t(j)] = static_cast<int32_t>(j);
    const int32_t k = s.n_expert_used;
    std::partial_sort(order.begin(), order.begin() + k, order.begin() + E, [&score](int32_t a, int32_t c) {
        return score[size_t(a)] > score[size_t(c)] || (score[size_t(a)] == score[size_t(c)] && a < c);
    });
    std::sort(order.begin(), order.begin() + k);
    const pebble_decoder::expert_cache & c = d.experts[size_t(i)];
    d.guessed.assign(order.begin(), order.begin() + k);
    for (pebble_decoder::staged & g : d.staging) g.layer = g.expert = -1;  // (a failed step may have left some)
    size_t free_slot = 0;
    for (int32_t g : d.guessed) {
        d.stats.expert_guesses++;
        if (std::find(c.expert.begin(), c.expert.end(), g) != c.expert.end()) continue;  // cached: nothing to move
        pebble_decoder::staged & slot = d.staging[free_slot++];
        TRY(restore_expert(d, i, g, slot.slot, stream));
        slot.layer = i;
        slot.expert = g;
        d.stats.expert_prefetches++;
    }
    return PEBBLE_OK;
}

// The routed FFN of the n rows of h (normed) into out [n][n_embd] float32 (pebble_layer_shape's experts):
// the router's scores (of h, or where the layer has ffn_gate_inp_s of router_input(x), x the hidden state) are
// read back, each token's experts chosen on the host, then expert by expert in increasing order the rows routed
// to it are gathered, run through its gate, up and down (its rows read once for all of them) and added,
// weighted (times its ffn_down_exps_s where given), to their tokens' out; the shared expert after, where given.
pebble_status experts_ffn(pebble_decoder & d, int32_t layer, int32_t n, const act_t * h, const float * x, float * out,
                          cudaStream_t stream) {
    const pebble_step_layer & L = d.layers[size_t(layer)];
    const pebble_layer_shape & s = L.shape;
    const pebble_layer_weights & w = L.weights;
    const int64_t e = s.n_embd, E = s.n_expert, ff = s.n_ff_exp;
    const int32_t k = s.n_expert_used;
    float * router = at_offset<float>(d.scratch, d.at.router), * y = at_offset<float>(d.scratch, d.at.y);
    float * gate = at_offset<float>(d.scratch, d.at.gate), * up = at_offset<float>(d.scratch, d.at.up);
    act_t * rows = at_offset<act_t>(d.scratch, d.at.rows), * act = at_offset<act_t>(d.scratch, d.at.act);
    const act_t * scored = h;
    if (w.ffn_gate_inp_s.data) {  // Gemma 4: the router's own input, in `rows` until the experts gather theirs
        TRY(router_input(L, x, n, rows, stream));
        scored = rows;
    }
    TRY(matvec_many(w.ffn_gate_inp.ggml_type, w.ffn_gate_inp.data, E, e, scored, n, router, stream));
    if (w.ffn_gate_inp_b.data) TRY(add_bias(router, n, E, w.ffn_gate_inp_b, 0, stream));
    CUDA_CHECK(cudaMemcpyAsync(d.router_host.data(), router, sizeof(float) * size_t(n) * size_t(E), cudaMemcpyDefault,
                               stream));
    const pebble_tensor_ref & exps_s = w.ffn_down_exps_s;  // Gemma 4's scale of each expert's output, or NULL
    if (exps_s.data) {  // read back with the scores (F32 or F16; a streamed layer's lies in its slot)
        CUDA_CHECK(cudaMemcpyAsync(d.exps_scale_host.data(), exps_s.data,
                                   size_t(E) * (exps_s.ggml_type == f32_type ? 4 : 2), cudaMemcpyDefault, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    // per token: its experts (a softmax over all, the k most probable, ties to the lower index) and weights;
    // with expert_gating 1, the k highest scores and a softmax over them alone (gpt-oss)
    int32_t chosen[PEBBLE_DECODER_MAX_BATCH][max_experts_used];
    float weight[PEBBLE_DECODER_MAX_BATCH][max_experts_used];
    std::vector<int32_t> & order = d.router_order;
    std::vector<float> & p = d.router_p;
    for (int32_t b = 0; b < n; b++) {
        const float * sc = d.router_host.data() + size_t(b) * size_t(E);
        for (int64_t j = 0; j < E; j++) order[size_t(j)] = static_cast<int32_t>(j);
        if (s.expert_gating == 1) {
            std::partial_sort(order.begin(), order.begin() + k, order.begin() + E, [sc](int32_t a, int32_t c) {
                return sc[a] > sc[c] || (sc[a] == sc[c] && a < c);
            });
            const float top = sc[order[0]];
            float total = 0.0f;
            for (int32_t r = 0; r < k; r++) total += expf(sc[order[size_t(r)]] - top);
            for (int32_t r = 0; r < k; r++) {
                chosen[b][r] = order[size_t(r)];
                const float wr = expf(sc[order[size_t(r)]] - top) / total;
                weight[b][r] = s.expert_scale == 1.0f ? wr : wr * s.expert_scale;
            }
            continue;
        }
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < E; j++) top = std::max(top, sc[j]);
        for (int64_t j = 0; j < E; j++) total += (p[size_t(j)] = expf(sc[j] - top));
        for (int64_t j = 0; j < E; j++) p[size_t(j)] /= total;
        std::partial_sort(order.begin(), order.begin() + k, order.begin() + E, [&p](int32_t a, int32_t c) {
            return p[size_t(a)] > p[size_t(c)] || (p[size_t(a)] == p[size_t(c)] && a < c);
        });
        float sum = 0.0f;
        for (int32_t r = 0; r < k; r++) sum += p[size_t(order[size_t(r)])];
        for (int32_t r = 0; r < k; r++) {
            chosen[b][r] = order[size_t(r)];
            float wr = p[size_t(order[size_t(r)])];
            if (s.expert_norm) wr = wr / sum;
            weight[b][r] = s.expert_scale == 1.0f ? wr : wr * s.expert_scale;
        }
    }
    for (int32_t b = 0; b < n && exps_s.data; b++) {  // Gemma 4: each expert's output times its own scale
        for (int32_t r = 0; r < k; r++) {
            weight[b][r] *= load_value(d.exps_scale_host.data(), exps_s.ggml_type, chosen[b][r]);
        }
    }
    if (L.experts_stored) {  // what the step has to run, and how many of the layer's guesses it runs
        std::fill(d.to_run.begin(), d.to_run.begin() + E, uint8_t(0));
        for (int32_t b = 0; b < n; b++) {
            for (int32_t r = 0; r < k; r++) d.to_run[size_t(chosen[b][r])] = 1;
        }
        for (int32_t g : d.guessed) d.stats.expert_guesses_right += d.to_run[size_t(g)];
        d.guessed.clear();
    }
    LAUNCH(zero_kernel, grid_for(int64_t(n) * e, threads), threads, stream, out, int64_t(n) * e);
    TRY(launched());
    const uint64_t gate_rows = row_bytes(w.ffn_gate_exps.ggml_type, e) * uint64_t(ff);
    const uint64_t up_rows = row_bytes(w.ffn_up_exps.ggml_type, e) * uint64_t(ff);
    const uint64_t down_rows = row_bytes(w.ffn_down_exps.ggml_type, ff) * uint64_t(e);
    for (int64_t j = 0; j < E; j++) {
        int32_t tokens[PEBBLE_DECODER_MAX_BATCH];
        float weights[PEBBLE_DECODER_MAX_BATCH];
        int32_t c = 0;
        for (int32_t b = 0; b < n; b++) {
            for (int32_t r = 0; r < k; r++) {
                if (chosen[b][r] == j) {
                    tokens[c] = b;
                    weights[c++] = weight[b][r];
                }
            }
        }
        if (c == 0) continue;
        for (int32_t r = 0; r < c; r++) {
            CUDA_CHECK(cudaMemcpyAsync(rows + int64_t(r) * e, h + int64_t(tokens[r]) * e, sizeof(act_t) * size_t(e),
                                       cudaMemcpyDefault, stream));
        }
        const uint8_t * g, * u, * dn;
        if (L.experts_stored) {  // from the layer's cache, restored first where it lacks the expert
            uint8_t * slot = nullptr;
            TRY(cached_expert(d, layer, static_cast<int32_t>(j), stream, &slot));
            g = slot;
            u = slot + gate_rows;
            dn = slot + gate_rows + up_rows;
        } else {
            g = static_cast<const uint8_t *>(w.ffn_gate_exps.data) + uint64_t(j) * gate_rows;
            u = static_cast<const uint8_t *>(w.ffn_up_exps.data) + uint64_t(j) * up_rows;
            dn = static_cast<const uint8_t *>(w.ffn_down_exps.data) + uint64_t(j) * down_rows;
        }
        const matvec_part gate_up[2] = {{w.ffn_gate_exps.ggml_type, g, ff, gate}, {w.ffn_up_exps.ggml_type, u, ff, up}};
        TRY(matvec_parts(gate_up, 2, e, rows, c, stream));  // (on the host one pass of the threads for both)
        if (w.ffn_gate_exps_b.data) { // gpt-oss: expert j's biases, its rows of the layer's stacks
            TRY(add_bias(gate, c, ff, w.ffn_gate_exps_b, j * ff, stream));
            TRY(add_bias(up, c, ff, w.ffn_up_exps_b, j * ff, stream));
        }
        TRY(gate_times_up(s.activation, gate, up, int64_t(c) * ff, act, stream));
        TRY(matvec_many(w.ffn_down_exps.ggml_type, dn, e, ff, act, c, y, stream));
        if (w.ffn_down_exps_b.data) TRY(add_bias(y, c, e, w.ffn_down_exps_b, j * e, stream));
        for (int32_t r = 0; r < c; r++) {
            TRY(add_scaled(out + int64_t(tokens[r]) * e, y + int64_t(r) * e, e, weights[r], stream));
        }
    }
    for (pebble_decoder::staged & g : d.staging) {  // guesses the layer did not run: free again
        if (g.layer == layer) g.layer = g.expert = -1;
    }
    if (s.n_ff_shexp > 0) {
        const int64_t sh = s.n_ff_shexp;
        TRY(matvec_many(w.ffn_gate_shexp.ggml_type, w.ffn_gate_shexp.data, sh, e, h, n, gate, stream));
        TRY(matvec_many(w.ffn_up_shexp.ggml_type, w.ffn_up_shexp.data, sh, e, h, n, up, stream));
        TRY(gate_times_up(0, gate, up, int64_t(n) * sh, act, stream));
        TRY(matvec_many(w.ffn_down_shexp.ggml_type, w.ffn_down_shexp.data, e, sh, act, n, y, stream));
        LAUNCH(shared_gate_kernel, grid_for(n, heads_per_block), dim3(warp_lanes, heads_per_block), stream, out, y, h, n,
               e, w.ffn_gate_inp_shexp.data, w.ffn_gate_inp_shexp.ggml_type);
        TRY(launched());
    }
    return PEBBLE_OK;
}

// Each layer whose experts are pebbles: its entries checked (one per expert, of the expert's gate, up and
// down rows); then the slots for experts made (pebble_step_model.expert_policy): each such layer's cache
// and the staging slots.
pebble_status place_experts(pebble_decoder & d, const char * fn) {
    d.experts.resize(d.layers.size());
    const pebble_step_model & m = d.model;
    if ((m.expert_policy != 0 && m.expert_policy != 1) || (m.expert_prefetch != 0 && m.expert_prefetch != 1)) {
        return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: expert_policy %d must be 0 (least recently used) or 1 (least "
                    "often used), expert_prefetch %d 0 or 1", fn, m.expert_policy, m.expert_prefetch);
    }
    uint64_t slot_bytes = 0, cached = 0;
    int32_t most_used = 0;
    bool uncached = false;
    for (size_t i = 0; i < d.layers.size(); i++) {
        const pebble_step_layer & L = d.layers[i];
        if (L.experts_stored == 0) continue;
        const pebble_layer_shape & s = L.shape;
        const bool merged = L.experts_stored == 2;
        if ((L.experts_stored != 1 && !merged) || s.n_expert < 1 || !(merged ? m.store : expert_store(d)) ||
            (!merged && (L.expert_ids < 0 || L.expert_ids > INT32_MAX - s.n_expert)) || L.expert_cache < 0 ||
            L.expert_cache > s.n_expert) {
            return fail(PEBBLE_ERR_INVALID_ARGUMENT, "%s: layer %zu: experts_stored %d needs 0, or 1 or 2 with experts "
                        "(n_expert %d), the model's store, (for 1) expert_ids %d at least 0 and expert_cache %d "
                        "within 0..n_expert", fn, i, L.experts_stored, s.n_expert, L.expert_ids, L.expert_cache);
        }
        pebble_decoder::expert_cache & c = d.experts[i];
        c.part_bytes[0] = row_bytes(L.weights.ffn_gate_exps.ggml_type, s.n_embd) * uint64_t(s.n_ff_exp);
        c.part_bytes[1] = row_bytes(L.weights.ffn_up_exps.ggml_type, s.n_embd) * uint64_t(s.n_ff_exp);
        c.part_bytes[2] = row_bytes(L.weights.ffn_down_exps.ggml_type, s.n_ff_exp) * uint64_t(s.n_embd);
        c.nbytes = c.part_bytes[0] + c.part_bytes[1] + c.part_bytes[2];
        for (int f = 0; f < 3 && merged; f++) {
            struct pebble_entry_info info{};
            const int32_t id = L.weight_ids[merged_expert_fields[f]];
            if (pebble_entry_info(m.store, static_cast<int32_t>(i), id, &info) != PEBBLE_OK ||
                info.nbytes != c.part_bytes[f] * uint64_t(s.n_expert)) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %zu: %s (tensor %d) is not an entry of %" PRIu64
                            " bytes (%d experts of %" PRIu64 ")", fn, i, weight_names[merged_expert_fields[f]], id,
                            c.part_bytes[f] * uint64_t(s.n_expert), s.n_expert, c.part_bytes[f]);
            }
        }
        for (int32_t j = 0; j < s.n_expert && !merged; j++) {
            struct pebble_entry_info info{};
            if (pebble_entry_info(expert_store(d), static_cast<int32_t>(i), L.expert_ids + j, &info) != PEBBLE_OK ||
                info.nbytes != c.nbytes) {
                return fail(PEBBLE_ERR_SIZE_MISMATCH, "%s: layer %zu: expert %d (tensor %d) is not an entry of %" PRIu64
                            " bytes (its gate, up and down rows)", fn, i, j, L.expert_ids + j, c.nbytes);
            }
        }
        c.expert.assign(size_t(L.expert_cache), -1);
        c.used.assign(size_t(L.expert_cache), 0);
        c.uses.assign(size_t(s.n_expert), 0);
        slot_bytes = std::max(slot_bytes, aligned(c.nbytes));
        cached += uint64_t(L.expert_cache);
        most_used = std::max(most_used, s.n_expert_used);
        uncached = uncached || L.expert_cache == 0;
    }
    if (slot_bytes == 0) return PEBBLE_OK;
    d.staging.resize(m.expert_prefetch ? size_t(most_used) : uncached ? 1 : 0);
    const uint64_t slots = cached + d.staging.size();
    TRY(alloc_scratch(&d.expert_buffer, slot_bytes * slots));
    d.stats.expert_device_bytes = slot_bytes * slots;
    uint8_t * at = d.expert_buffer;
    for (pebble_decoder::expert_cache & c : d.experts) {
        for (size_t k = 0; k < c.expert.size(); k++, at += slot_bytes) c.slot.push_back(at);
    }
    for (pebble_decoder::staged & g : d.staging) {
        g.slot = at;
        at += slot_bytes;
    }
    d.to_run.assign(size_t(d.max_expert), 0);
    d.guess_score.assign(size_t(d.max_expert), 0.0f);
    d.guessed.reserve(size_t(most_used));
    return PEBBLE_OK;
}

} // namespace pebble_internal
